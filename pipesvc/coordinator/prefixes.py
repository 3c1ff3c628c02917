"""Which prompt prefixes the stages keep, so a prompt that starts as an earlier one did runs
only its rest (see [Note: prefix reuse] in ``pipesvc.stage.compute.sessions``). No gRPC here.

[Note: prefix index] The coordinator names prefixes by the tokens they hold. A prompt is cut
into blocks of ``BLOCK`` tokens, and the running hash of its first ``k`` blocks names the prefix
of ``k * BLOCK`` tokens. After a one-row session's first run the stages keep its cache's first
``P`` positions, ``P`` the largest multiple of ``BLOCK`` short of the prompt (its last token
must still run, to give the first new token's logits), under the name of those ``P`` tokens;
every block boundary up to ``P`` is then indexed to it, since a prompt sharing only the first
``k`` blocks can start from the first ``k * BLOCK`` positions of the same kept cache. A new
prompt starts from the longest indexed boundary it shares, short of its own length. The index
holds at most ``capacity`` kept prefixes, least recently used out first (the coordinator then
releases them on the stages), and only for the plan epoch they were kept in (a new assignment
starts with no caches). A stage that dropped a prefix on its own (its KV budget) fails the run
of a session starting from it; the coordinator forgets the prefix and replays the session.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 16
"""Tokens per block: the granularity at which prompts share prefixes."""
CAPACITY = 64
"""Kept prefixes a job's index holds at most."""


@dataclass(frozen=True, slots=True)
class Prefix:
    """A kept prefix to start from, or to keep: its name and how many positions of it."""

    name: str
    positions: int


def _boundaries(tokens: torch.Tensor, limit: int) -> list[str]:
    """The names of ``tokens``' first ``k`` blocks, for each ``k * BLOCK <= limit``."""
    data = tokens.to(torch.int64).contiguous().numpy().tobytes()
    digest = hashlib.sha256()
    names = []
    width = BLOCK * 8
    for k in range(1, limit // BLOCK + 1):
        digest.update(data[(k - 1) * width : k * width])
        names.append("prefix-" + digest.copy().hexdigest()[:40])
    return names


class PrefixIndex:
    """The prefixes one job's stages keep, by the tokens they hold (see [Note: prefix index])."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._epoch: int | None = None
        self._kept: OrderedDict[str, list[str]] = OrderedDict()
        """Kept prefix -> the boundaries indexed to it; least recently used first."""
        self._boundaries: dict[str, tuple[str, int]] = {}
        """Boundary name -> (kept prefix, positions)."""

    def _at(self, epoch: int) -> None:
        if epoch != self._epoch:  # the stages hold nothing of another epoch
            self._epoch = epoch
            self._kept.clear()
            self._boundaries.clear()

    def find(self, tokens: torch.Tensor, epoch: int) -> Prefix | None:
        """The longest kept prefix ``tokens`` (one row) starts with, short of all of it."""
        self._at(epoch)
        for name in reversed(_boundaries(tokens, int(tokens.shape[0]) - 1)):
            found = self._boundaries.get(name)
            if found is not None:
                self._kept.move_to_end(found[0])
                return Prefix(*found)
        return None

    def to_keep(self, tokens: torch.Tensor, epoch: int) -> Prefix | None:
        """What to keep of a prompt (one row) after its first run, or None: too short, or kept
        already."""
        self._at(epoch)
        names = _boundaries(tokens, int(tokens.shape[0]) - 1)
        if not names or names[-1] in self._boundaries:
            return None
        return Prefix(names[-1], len(names) * BLOCK)

    def kept(self, tokens: torch.Tensor, prefix: Prefix, epoch: int) -> list[str]:
        """Records that the stages keep ``prefix`` of ``tokens``; returns the prefixes it
        pushes out of the index, which the stages should drop."""
        if self._epoch is not None and epoch < self._epoch:
            return [prefix.name]  # kept in an epoch that is over: nothing to index
        self._at(epoch)
        names = _boundaries(tokens, prefix.positions)
        self._kept[prefix.name] = names
        self._kept.move_to_end(prefix.name)
        for k, name in enumerate(names, start=1):
            self._boundaries[name] = (prefix.name, k * BLOCK)
        evicted = []
        while len(self._kept) > self._capacity:
            evicted.append(next(iter(self._kept)))
            self.forget(evicted[-1])
        return evicted

    def forget(self, name: str) -> None:
        """Drops a kept prefix from the index (its stages no longer keep it)."""
        for boundary in self._kept.pop(name, []):
            if self._boundaries.get(boundary, ("", 0))[0] == name:
                del self._boundaries[boundary]
        # Boundaries another kept prefix covers too point to it again.
        for other, names in self._kept.items():
            for k, boundary in enumerate(names, start=1):
                self._boundaries.setdefault(boundary, (other, k * BLOCK))

    def __len__(self) -> int:
        return len(self._kept)
