"""Which tied copies a stage holds and whom it swaps with (pure: ``pipesvc.core.tying``)."""

from __future__ import annotations

import pytest

from pipesvc.core.tying import stage_ties
from pipesvc.errors import InvalidArgumentError

GROUPS = [("0.embed.weight", "5.head.weight")]


def test_copies_on_two_stages_swap_and_count_once_in_the_norm() -> None:
    ranges = [(0, 2), (2, 4), (4, 6)]
    first, middle, last = (stage_ties(GROUPS, ranges, rank) for rank in range(3))
    assert first.local == {0: ("0.embed.weight",)} and first.peers == {0: 2}
    assert last.local == {0: ("5.head.weight",)} and last.peers == {0: 0}
    assert not middle and middle.peer_ranks() == []
    # The copy in the lowest layer counts in the global norm; the other is left out.
    assert first.out_of_norm == frozenset() and last.out_of_norm == {"5.head.weight"}
    assert last.groups_with(0) == [0] and first.peer_ranks() == [2]


def test_copies_on_one_stage_need_no_peer() -> None:
    ties = stage_ties(GROUPS, [(0, 6)], 0)
    assert ties.local == {0: ("0.embed.weight", "5.head.weight")} and ties.peers == {}
    assert ties.out_of_norm == {"5.head.weight"}


@pytest.mark.parametrize(
    ("groups", "ranges", "message"),
    [
        ([("0.a", "1.b", "2.c")], [(0, 1), (1, 2), (2, 3)], r"on stages \[0, 1, 2\]"),
        ([("0.a",)], [(0, 1)], "at least two keys"),
        ([("0.a", "7.b")], [(0, 3)], "layer 7, which no stage holds"),
        ([("a", "1.b")], [(0, 3)], "not of the form"),
    ],
)
def test_groups_that_cannot_be_swapped_are_refused(
    groups: list[tuple[str, ...]], ranges: list[tuple[int, int]], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        stage_ties(groups, ranges, 0)
