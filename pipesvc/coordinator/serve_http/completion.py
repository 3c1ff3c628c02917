"""One completion of the HTTP API: its settings read from the request's JSON, and its text as
the job's generation session makes tokens (stop strings, end of sequence, the token limit).

[Note: stop strings on decoded text] ``stop`` strings are matched on the decoded text, not on
tokens: a stop string can span tokens, and a token can end inside one. After each token the
whole output is decoded again; text is handed out only up to where a stop string could still
begin (the longest tail that is a start of one is held back, and so is a trailing U+FFFD, a
character whose bytes are not all there yet). The first stop string found ends the
completion, the text before it is the last piece, and the session is closed at once, which
frees its caches on every stage.

[Note: log-probabilities over HTTP] A request that asks for log-probabilities (``logprobs``: a
count for completions, true for chat with ``top_logprobs`` alternatives) gets each generated
token's text, its log-probability and the most likely alternatives' (see [Note:
log-probabilities] in ``pipesvc.core.sampling``), and for completions each token's offset in
the text. A token goes out with the first piece of text that reaches past its start, so a
token whose text is held back (it may start a stop string) goes out later, and one that starts
where a stop string begins, or after, never does; an end-of-sequence token is not reported.
A token's text is its own decoding, and a chat token's ``bytes`` are that text's UTF-8 (a
token that ends inside a character decodes to U+FFFD on its own). ``echo`` (the prompt's own
log-probabilities) is not served: the last stage returns only the next token's logits.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any

from pipesvc.coordinator.serve_http.detokenizer import IncrementalText
from pipesvc.coordinator.serve_http.served_model import ModelText
from pipesvc.coordinator.session import MAX_NEW_TOKENS, Made
from pipesvc.core.sampling import MAX_TOP_LOGPROBS, Sampling, TokenLogprobs
from pipesvc.errors import InvalidArgumentError

MAX_STOPS = 4
"""Most stop strings a request may give (OpenAI's limit)."""


class BadRequest(InvalidArgumentError):
    """A request the API refuses with a 400, naming the parameter at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Settings:
    """What a request asks of its completion."""

    max_tokens: int | None
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    """How many alternatives' log-probabilities to report beside each token's own (None: no
    log-probabilities; see [Note: log-probabilities over HTTP])."""


def _number(body: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{key} must be a number; got {value!r}", key)
    return float(value)


def _integer(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{key} must be an integer; got {value!r}", key)
    return value


def read_settings(body: Mapping[str, Any], *, chat: bool) -> Settings:
    """The settings of a completions (or, with ``chat``, chat completions) request.

    Raises:
        BadRequest: a setting is of the wrong type or out of range, or asks for what this
            server does not do (``n`` other than 1, ``logprobs``, ``echo``, tools).
    """
    n = _integer(body, "n")
    if n not in (None, 1):
        raise BadRequest(f"n ({n}) must be 1: this server makes one choice per request", "n")
    best_of = _integer(body, "best_of")
    if best_of not in (None, 1):
        raise BadRequest(f"best_of ({best_of}) must be 1", "best_of")
    unsupported = ("echo", "tools", "functions", "suffix") + (() if chat else ("top_logprobs",))
    for key in unsupported:
        if body.get(key) not in (None, False, [], ""):
            raise BadRequest(f"{key} is not supported by this server", key)
    logprobs = _chat_logprobs(body) if chat else _top_count(body, "logprobs")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    max_tokens = _integer(body, key)
    if max_tokens is not None and not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise BadRequest(f"{key} ({max_tokens}) must be in [1, {MAX_NEW_TOKENS}]", key)
    temperature = _number(body, "temperature", 1.0)
    assert temperature is not None
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature ({temperature}) must be in [0, 2]", "temperature")
    top_p = _number(body, "top_p", None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p ({top_p}) must be in (0, 1]", "top_p")
    seed = _integer(body, "seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise BadRequest(f"seed ({seed}) must be in [0, 2**63)", "seed")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise BadRequest(
            f"stop ({stop!r}) must be a non-empty string or a list of at most {MAX_STOPS}",
            "stop",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise BadRequest(f"stream must be true or false; got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options must be an object; got {options!r}", "stream_options")
    return Settings(
        max_tokens=max_tokens,
        sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed),
        stop=tuple(stops),
        stream=bool(stream),
        include_usage=bool(stream) and bool(options.get("include_usage")),
        logprobs=logprobs,
    )


def _top_count(body: Mapping[str, Any], key: str) -> int | None:
    """A count of alternatives (``logprobs`` of completions, ``top_logprobs`` of chat)."""
    count = _integer(body, key)
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{key} ({count}) must be in [0, {MAX_TOP_LOGPROBS}]", key)
    return count


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """The alternatives a chat request asks for: ``top_logprobs`` (0 by default) when
    ``logprobs`` is true, None when it is not."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest(f"logprobs must be true or false; got {wanted!r}", "logprobs")
    top = _top_count(body, "top_logprobs")
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if wanted else None


def prompt_ids(prompt: object, text: ModelText) -> list[int]:
    """The token ids of a completions request's ``prompt``: text, or token ids (one prompt).

    Raises:
        BadRequest: not one prompt, or empty, or ids outside the vocabulary.
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return text.encode(prompt)
    vocab = int(text.tokenizer.get_vocab_size())
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
    ):
        return list(prompt)
    raise BadRequest(
        f"prompt must be a non-empty string or a non-empty list of token ids in [0, {vocab}) "
        "(one prompt per request)",
        "prompt",
    )


def chat_ids(messages: object, text: ModelText) -> list[int]:
    """The token ids of a chat's ``messages`` through the model's chat template.

    Raises:
        BadRequest: the messages are not a non-empty list of ``{role, content}``.
        InvalidArgumentError: the model has no chat template.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    plain = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: the text ones
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            content = "".join(p for p in parts if isinstance(p, str))
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or not isinstance(content, str | None):
            raise BadRequest(
                f"message {message!r} must be an object with a string role and text content",
                "messages",
            )
        plain.append({"role": role, "content": content or ""})
    ids = text.encode(text.chat(plain), special_tokens=False)
    if not ids:
        raise BadRequest("the chat template made an empty prompt of these messages", "messages")
    return ids


@dataclass(frozen=True, slots=True)
class Scored:
    """One generated token as the API reports it (see [Note: log-probabilities over HTTP])."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    """The most likely tokens' texts and log-probabilities, most likely first."""
    offset: int
    """Where the token's text starts in the completion's text."""


class Completion:
    """The text of one generation session, piece by piece (blocking: run it in a worker
    thread). See [Note: stop strings on decoded text]."""

    def __init__(
        self,
        steps: Generator[Made, None, None],
        text: ModelText,
        prompt_tokens: int,
        max_tokens: int,
        stop: tuple[str, ...],
    ) -> None:
        self._steps = steps
        self._text = text
        self._stop = stop
        self._max_tokens = max_tokens
        self._sent = 0
        """Characters of the decoded output handed out so far."""
        self._decoded = IncrementalText(text.decode)
        """The text of the tokens so far (see [Note: incremental detokenization] in
        detokenizer.py)."""
        self._scored: list[Scored] | None = None
        """Every token's log-probabilities so far, when the session reports them."""
        self._reported = 0
        """Of ``_scored``, those handed out (``take_logprobs``)."""
        self._until = 0.0
        """Tokens starting before this character may be handed out."""
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        """``stop`` (a stop string or end of sequence) or ``length``; None while running."""
        self._more = False
        """The last token taken had the next one made already (``Made.more``)."""

    def step(self) -> str:
        """The next piece of text (non-empty), or the last piece once finished ('' when
        there is none left); ends the session once finished."""
        while self.finish_reason is None:
            piece = self._advance()
            if piece or self.finish_reason is not None:
                return piece
        return ""

    def step_with_ready(self) -> str:
        """``step``'s piece, and the text of the tokens made already after it (a run of
        several decode steps makes them at once), as one piece: a stream sends them in one
        chunk, not one event each at the same moment."""
        piece = self.step()
        while self.finish_reason is None and self._more:
            piece += self._advance()
        return piece

    def close(self) -> None:
        """Ends the session (its caches are released on every stage); idempotent."""
        self._steps.close()

    def take_logprobs(self) -> list[Scored] | None:
        """The tokens of the text handed out since the last call, with their
        log-probabilities (None: the session reports none)."""
        if self._scored is None:
            return None
        start = end = self._reported
        while end < len(self._scored) and self._scored[end].offset < self._until:
            end += 1
        self._reported = end
        return self._scored[start:end]

    def _score(self, token: int, logprobs: TokenLogprobs) -> None:
        """Records ``token``'s log-probabilities (row 0 of the step's)."""
        decode = self._text.decode
        top = zip(logprobs.top_ids[0].tolist(), logprobs.top[0].tolist(), strict=True)
        scored = Scored(
            text=decode([token]),
            logprob=float(logprobs.chosen[0]),
            top=tuple((decode([i]), value) for i, value in top),
            offset=len(self._decoded.full.rstrip("\ufffd")),
        )
        if self._scored is None:
            self._scored = []
        self._scored.append(scored)

    def _advance(self) -> str:
        try:
            made = next(self._steps)
        except StopIteration:
            return self._finish("length", None)
        token = int(made.tokens[0])
        self._more = made.more
        self.completion_tokens += 1
        if token in self._text.eos_ids:
            return self._finish("stop", None)
        if made.logprobs is not None:
            self._score(token, made.logprobs)
        self._decoded.add(token)
        decoded = self._decoded.full
        begin = max(0, self._sent - max((len(s) for s in self._stop), default=0))
        found = [i for i in (decoded.find(s, begin) for s in self._stop) if i >= 0]
        if found:
            return self._finish("stop", decoded, min(found))
        if self.completion_tokens >= self._max_tokens:
            return self._finish("length", decoded)
        safe = len(decoded) - self._held(decoded)
        piece = decoded[self._sent : safe] if safe > self._sent else ""
        self._sent = max(self._sent, safe)
        self._until = self._sent
        return piece

    def _held(self, decoded: str) -> int:
        """Characters at the end of ``decoded`` not to hand out yet."""
        held = len(decoded) - len(decoded.rstrip("\ufffd"))
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(decoded)), 0, -1):
                if decoded.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held

    def _finish(self, reason: str, decoded: str | None, end: int | None = None) -> str:
        self.finish_reason = reason
        self.close()
        if decoded is None:
            decoded = self._decoded.full
        # Every token is reported, unless a stop string cut the text before it.
        self._until = math.inf if end is None else end
        end = len(decoded) if end is None else end
        piece = decoded[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece
