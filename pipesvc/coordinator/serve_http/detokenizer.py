"""The text of a completion's tokens as they come, decoding only the last few each time.

[Note: incremental detokenization] A streamed completion needs its text after every token (for
the piece to send and for stop strings). Decoding every token so far each time costs a
completion of n tokens O(n^2): at 4000 tokens, a millisecond of the coordinator's CPU per
session per step. ``IncrementalText`` decodes a window instead, as vLLM and ``transformers``'
``TextStreamer`` do: the tokens from ``_start`` on, and the text they add is the window's text
past that of its first ``_read - _start`` tokens. Both decodes start at the same token, so
whatever a tokenizer does at the start of a text (a SentencePiece decoder drops the first
token's leading space) cancels out. A window whose text ends in U+FFFD holds the first bytes
of a character whose last ones have not come: the text is not advanced past it until they do
(``pending`` has it meanwhile, so ``text + pending`` is what decoding every token gives). If a
window's text does not start with its first tokens' text (a tokenizer whose decoding of earlier
tokens depends on later ones), everything is decoded once, and the window starts after it.
Pure: no gRPC, no tokenizer of its own (``decode`` is given).
"""

from __future__ import annotations

from collections.abc import Callable

CONTEXT = 4
"""Tokens before the new ones that a window starts with, whatever text they made."""


class IncrementalText:
    """The text of a growing list of token ids (see [Note: incremental detokenization])."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0
        """Where the window starts."""
        self._read = 0
        """Tokens whose text is in ``text``."""
        self.text = ""
        """The text of the first ``_read`` tokens."""
        self.pending = ""
        """The text of the tokens after those, while it ends in an incomplete character."""

    @property
    def full(self) -> str:
        """The text of every token so far, as decoding them all gives it."""
        return self.text + self.pending

    def add(self, token: int) -> str:
        """Adds ``token``; returns the text it completes ('' while a character is incomplete)."""
        self._ids.append(token)
        window = self._decode(self._ids[self._start :])
        before = self._decode(self._ids[self._start : self._read])
        if not window.startswith(before):  # see the note: start again after all of it
            whole = self._decode(self._ids)
            added = whole[len(self.text) :] if whole.startswith(self.text) else whole
            self.text, self.pending = whole, ""
            self._start = self._read = len(self._ids)
            return added
        added = window[len(before) :]
        if added.endswith("\ufffd"):
            self.pending = added
            return ""
        self.text += added
        self.pending = ""
        self._read = len(self._ids)
        self._start = max(0, self._read - CONTEXT)
        return added
