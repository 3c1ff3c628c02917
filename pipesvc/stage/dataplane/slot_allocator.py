"""Slot placement in a shared-memory area: where each payload goes (pure bookkeeping)."""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

ALIGN = 64
"""Every slot starts at a multiple of this many bytes."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one payload went in an area."""

    seq: int
    offset: int


def round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SlotAllocator:
    """Slot placement in an area of ``capacity`` bytes (offsets from 0; pure bookkeeping).

    Live slots are kept in placement order (they are released in that order) and the free
    space as a sorted list of merged ranges, so placing a slot looks only at the gaps, not at
    every live slot: a GPipe stage keeps all of a step's activations live, and a scan over them
    per placement made a step quadratic in its micro-batches.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._live: collections.deque[tuple[int, int, int]] = collections.deque()  # seq, start, end
        self._free: list[tuple[int, int]] = [(0, capacity)]  # disjoint, sorted, merged
        self._next_seq = 1

    @property
    def live(self) -> int:
        """Slots placed and not yet released."""
        return len(self._live)

    def release(self, consumed_seq: int) -> None:
        """Frees every slot numbered ``consumed_seq`` or lower."""
        while self._live and self._live[0][0] <= consumed_seq:
            _, begin, end = self._live.popleft()
            self._give_back(begin, end)

    def retract(self) -> None:
        """Takes back the newest slot (placed but never handed out)."""
        _, begin, end = self._live.pop()
        self._give_back(begin, end)
        self._next_seq -= 1

    def place(self, num_bytes: int) -> Slot | None:
        """The lowest slot for ``num_bytes`` that overlaps no live slot, or None when none fits
        now. Lowest first keeps a link's touched (resident) pages to what it has in flight."""
        size = round_up(max(num_bytes, 1))
        index = next((i for i, (b, e) in enumerate(self._free) if e - b >= size), None)
        if index is None:
            return None
        begin, end = self._free[index]
        if end - begin == size:
            del self._free[index]
        else:
            self._free[index] = (begin + size, end)
        slot = Slot(self._next_seq, begin)
        self._live.append((slot.seq, begin, begin + size))
        self._next_seq += 1
        return slot

    @property
    def high(self) -> int:
        """End of the highest live slot (0 when none is live)."""
        if not self._live:
            return 0
        last_begin, last_end = self._free[-1] if self._free else (0, 0)
        return last_begin if last_end == self.capacity else self.capacity

    def _give_back(self, begin: int, end: int) -> None:
        """Returns ``[begin, end)`` to the free list, merged with the ranges it touches."""
        index = bisect.bisect_left(self._free, (begin, end))
        if index > 0 and self._free[index - 1][1] == begin:
            index -= 1
            begin = self._free.pop(index)[0]
        if index < len(self._free) and self._free[index][0] == end:
            end = self._free.pop(index)[1]
        self._free.insert(index, (begin, end))
