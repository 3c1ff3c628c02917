"""Several sessions' caches stacked into one micro-batch's, and cut back (no gRPC here).

[Note: fused decode] A decode step computes one new position per row: little work for each
weight it reads, so the steps of many sessions cost less as one micro-batch than as many. The
coordinator fuses the parts of the sessions in a run that extend their caches by one position
into one micro-batch: their new tokens one part after another, each row's position, and each
row's padding mask left-padded with zeros to the longest cache plus the new position. A stage
stacks the parts' caches the same way (each layer's keys and values left-padded with zeros to
the longest, then joined along the rows), runs its layers once on the fused micro-batch, and
cuts the grown cache back into each part's rows and length. The mask hides the zeros, so every
row attends to exactly its own keys, and its numbers are its own step's up to the rounding of
a larger matrix product. Prompts (parts that start their caches, and replays) fuse the same way
into a micro-batch of their own: their tokens left-padded to the longest, and each part keeps
the last of the new positions, as many as it brought (``CacheRef.positions``). The two kinds
never share a micro-batch: a part's positions would not be contiguous. The stage keeps a decode
run's stack for the next step of the same parts (see [Note: kept stack] in
``pipesvc.stage.compute.sessions``); anything else cuts it back into copies of each part's own
rows and positions (a view would keep the whole stacked, padded cache alive: see [Note: cache
memory] there). A model offers
this with a ``CacheLayout`` (how its cache shows its tensors) and by reading
``attention_mask``; a model with sliding-window layers does not (a window's cache drops old
positions, so the rows would not line up) and runs each part as its own micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipesvc.errors import InvalidArgumentError
from pipesvc.models import CacheLayout, CacheTensors


@dataclass(frozen=True, slots=True)
class StackedCaches:
    """The stacked cache of a fused micro-batch and what it takes to cut it back."""

    layout: CacheLayout
    cache: Any
    """The cache to run the fused micro-batch through."""
    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    """Each part's cached positions before the run."""
    positions: tuple[int, ...]
    """The positions each part adds in the run."""
    longest: int

    def split(self) -> list[Any]:
        """Each part's cache after the run: its rows, its own positions and the new ones, copied
        out of the stacked cache (see [Note: cache memory] in ``pipesvc.stage.compute.sessions``).

        Raises:
            InvalidArgumentError: a part adds more positions than the run did, or a part with a
                cache adds fewer (its positions would not be contiguous).
        """
        tensors = self.layout.tensors(self.cache)
        if not tensors:  # no layer of this stage keeps a cache
            return [self.layout.build({}) for _ in self.rows]
        grown = max(k.shape[2] for k, _ in tensors.values()) - self.longest
        parts, row = [], 0
        for rows, length, added in zip(self.rows, self.lengths, self.positions, strict=True):
            if added > grown or (length and added != grown):
                raise InvalidArgumentError(
                    f"a part with {length} cached positions adds {added} in a fused run that "
                    f"added {grown}; expected {grown if length else f'at most {grown}'}"
                )
            part: CacheTensors = {}
            for name, (keys, values) in tensors.items():
                keep = length + added
                part[name] = (
                    keys[row : row + rows, :, keys.shape[2] - keep :].clone(),
                    values[row : row + rows, :, values.shape[2] - keep :].clone(),
                )
            parts.append(self.layout.build(part))
            row += rows
        return parts


def stack(
    layout: CacheLayout,
    caches: Sequence[Any],
    rows: Sequence[int],
    positions: Sequence[int],
) -> StackedCaches:
    """Stacks the parts' ``caches`` (``rows[i]`` rows each, adding ``positions[i]`` in the run)
    into one, left-padded with zeros.

    Raises:
        InvalidArgumentError: the caches hold different layers, a layer's tensors do not have
            the part's rows, or a cache's layers differ in length or shape.
    """
    if len(caches) != len(rows) or len(rows) != len(positions) or not caches:
        raise InvalidArgumentError(
            f"{len(caches)} caches for {len(rows)} parts adding {len(positions)} positions"
        )
    parts = [layout.tensors(cache) for cache in caches]
    names = list(parts[0])
    reference = _kinds(parts[0])
    lengths = []
    for index, (part, count) in enumerate(zip(parts, rows, strict=True)):
        if set(part) != set(names):
            raise InvalidArgumentError(
                f"part {index} of a fused micro-batch caches layers {sorted(map(str, part))}; "
                f"the first caches {sorted(map(str, names))}"
            )
        tensors = [t for pair in part.values() for t in pair]
        seen = {t.shape[2] for t in tensors} or {0}
        row_counts = {t.shape[0] for t in tensors} or {count}
        if len(seen) != 1 or row_counts != {count} or (tensors and _kinds(part) != reference):
            raise InvalidArgumentError(
                f"part {index} of a fused micro-batch: its cache holds rows {sorted(row_counts)}, "
                f"lengths {sorted(seen)}, heads/dims/dtypes {sorted(map(str, _kinds(part)))}; "
                f"expected {count} rows, one length, and {sorted(map(str, reference))}"
            )
        lengths.append(seen.pop())
    longest = max(lengths)
    fused: CacheTensors = {
        name: (
            _stack_left([part[name][0] for part in parts], longest),
            _stack_left([part[name][1] for part in parts], longest),
        )
        for name in names
    }
    return StackedCaches(
        layout, layout.build(fused), tuple(rows), tuple(lengths), tuple(positions), longest
    )


def _kinds(part: CacheTensors) -> set[tuple[int, int, torch.dtype]]:
    """The heads, head dimensions and dtypes of a cache's tensors."""
    return {(t.shape[1], t.shape[3], t.dtype) for pair in part.values() for t in pair}


def _stack_left(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """``[rows_i, heads, length_i, dim]`` tensors as one ``[sum rows, heads, length, dim]``,
    each right-aligned (zeros before its own positions)."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    out = first.new_zeros((rows, first.shape[1], length, first.shape[3]))
    row = 0
    for t in tensors:
        out[row : row + t.shape[0], :, length - t.shape[2] :] = t
        row += t.shape[0]
    return out
