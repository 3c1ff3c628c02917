"""Tied parameters over a plan: which copies a stage holds, and which stage holds the others.

[Note: tied parameters] A model may tie parameters: GPT-2 and many small models use the input
embedding's matrix as the LM head's weight. In one process that is one tensor with one
gradient, the sum of both uses. In a pipeline the embedding (layer 0) and the head (the last
layer) usually sit on different stages, so each of them holds a copy. A model declares its
tied groups as global keys (``"{layer}.{name}"``, see ``pipesvc.models.tied_parameters``);
at the end of every training run, before the stage reports the run done:

- the copies on one stage add their gradients up (``partial``);
- where the group's other copies sit on another stage, the two stages swap their partial sums
  (the higher rank calls the lower one) and each adds the other's;
- every copy's gradient becomes that total.

Float addition is commutative, so ``a + b`` on one stage and ``b + a`` on the other are the
same bits: every copy gets the same gradient and, from the same weights and optimizer state,
the same update, so the copies stay bit-identical, and training equals the tied model in one
process (up to the order of the sums). For global norm clipping a group counts once: only its
copy with the lowest layer index is in its stage's norm. A group may span at most two stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipesvc.errors import InvalidArgumentError


def layer_of(key: str) -> int:
    """The global layer of a key ``"{layer}.{name}"``."""
    head, _, rest = key.partition(".")
    if not head.isdigit() or not rest:
        raise InvalidArgumentError(f"tied key {key!r} is not of the form '<layer>.<name>'")
    return int(head)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTies:
    """The tied groups one stage takes part in."""

    local: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Group index -> the keys of its copies on this stage."""
    peers: dict[int, int] = field(default_factory=dict)
    """Group index -> the rank holding the group's other copies (groups on two stages only)."""
    out_of_norm: frozenset[str] = frozenset()
    """Keys left out of this stage's gradient norm (a group counts once, at its first copy)."""

    def __bool__(self) -> bool:
        return bool(self.local)

    def peer_ranks(self) -> list[int]:
        """The ranks this stage swaps with, in increasing order."""
        return sorted(set(self.peers.values()))

    def groups_with(self, peer: int) -> list[int]:
        """The groups this stage swaps with rank ``peer``, in increasing order."""
        return sorted(g for g, p in self.peers.items() if p == peer)


def stage_ties(
    groups: Sequence[Sequence[str]], ranges: Sequence[tuple[int, int]], rank: int
) -> StageTies:
    """The ties of the stage of ``rank``, given each rank's ``[start, end)`` layer range.

    Raises:
        InvalidArgumentError: a group has fewer than two keys, a key names a layer no stage
            holds, or a group's copies lie on more than two stages.
    """

    def holder(key: str) -> int:
        layer = layer_of(key)
        for r, (start, end) in enumerate(ranges):
            if start <= layer < end:
                return r
        raise InvalidArgumentError(f"tied key {key!r} is in layer {layer}, which no stage holds")

    local: dict[int, tuple[str, ...]] = {}
    peers: dict[int, int] = {}
    out: set[str] = set()
    for index, keys in enumerate(groups):
        if len(keys) < 2:
            raise InvalidArgumentError(f"tied group {list(keys)} needs at least two keys")
        holders = {key: holder(key) for key in keys}
        ranks = sorted(set(holders.values()))
        if len(ranks) > 2:
            raise InvalidArgumentError(
                f"tied group {list(keys)} lies on stages {ranks}; at most two are supported"
            )
        here = tuple(k for k in keys if holders[k] == rank)
        if not here:
            continue
        local[index] = here
        others = [r for r in ranks if r != rank]
        if others:
            peers[index] = others[0]
        first = min(keys, key=layer_of)
        out.update(k for k in here if k != first)
    return StageTies(local=local, peers=peers, out_of_norm=frozenset(out))
