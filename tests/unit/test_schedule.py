"""Unit tests for pipesvc.core.schedule: actions, GPipe/1F1B lists, the simulator and its errors."""

from __future__ import annotations

import pytest

from pipesvc.core.schedule import (
    Action,
    ActionKind,
    all_stage_actions,
    forward_only_actions,
    ideal_bubble,
    max_in_flight,
    max_in_flight_of,
    schedule_names,
    stage_actions,
)
from pipesvc.core.schedule_sim import bubble_fraction, format_grid, simulate, validate
from pipesvc.errors import InvalidArgumentError

SCHEDULES = schedule_names()


def parse_all(text: str) -> list[Action]:
    return [Action.parse(word) for word in text.split()]


def plan(schedule: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    return [
        stage_actions(schedule, rank=r, num_stages=num_stages, num_microbatches=num_microbatches)
        for r in range(num_stages)
    ]


@pytest.mark.parametrize("text", ["F0", "B0", "F7", "B12", "F1234", "W0", "W3"])
def test_action_round_trip(text: str) -> None:
    action = Action.parse(text)
    assert str(action) == text
    assert repr(action) == text
    assert Action.parse(str(action)) == action


def test_action_fields() -> None:
    assert Action.parse("B12") == Action(ActionKind.BACKWARD, 12)
    assert Action.parse("F3").kind is ActionKind.FORWARD
    assert Action.parse("F3").microbatch_index == 3
    assert Action.parse("W3") == Action(ActionKind.WEIGHT, 3)


@pytest.mark.parametrize(
    "text", ["", "F", "X1", "f1", "F-1", "F01", " F1", "F1 ", "1F0", "F\u0661"]
)
def test_action_parse_errors(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot parse action"):
        Action.parse(text)


def test_action_rejects_bad_index() -> None:
    with pytest.raises(InvalidArgumentError, match=r"microbatch_index \(-1\)"):
        Action(ActionKind.FORWARD, -1)


def test_gpipe_and_1f1b_lists() -> None:
    assert plan("gpipe", 2, 3)[0] == parse_all("F0 F1 F2 B0 B1 B2")
    assert plan("1f1b", 3, 4) == [
        parse_all("F0 F1 F2 B0 F3 B1 B2 B3"),
        parse_all("F0 F1 B0 F2 B1 F3 B2 B3"),
        parse_all("F0 B0 F1 B1 F2 B2 F3 B3"),
    ]
    # Fewer micro-batches than the warm-up: all forwards, then all backwards.
    assert plan("1f1b", 4, 2)[0] == parse_all("F0 F1 B0 B1")


def earliest_ticks(actions_per_stage: list[list[Action]]) -> dict[tuple[int, Action], int]:
    """The oracle for the simulator, computed another way: each action's tick as a longest
    path, ``tick = 1 + max(tick of the previous action of its rank, ticks of what it needs)``
    (a forward needs rank - 1's forward; a backward its own forward and rank + 1's backward; a
    weight gradient its own backward),
    resolved by recursion rather than by stepping a clock."""
    num_stages = len(actions_per_stage)
    position = {(r, a): i for r, row in enumerate(actions_per_stage) for i, a in enumerate(row)}
    ticks: dict[tuple[int, Action], int] = {}

    def tick(rank: int, action: Action) -> int:
        if (rank, action) not in ticks:
            index = position[(rank, action)]
            before = [tick(rank, actions_per_stage[rank][index - 1])] if index else []
            i = action.microbatch_index
            if action.kind is ActionKind.FORWARD:
                needs = [(rank - 1, action)] if rank > 0 else []
            elif action.kind is ActionKind.WEIGHT:
                needs = [(rank, Action(ActionKind.BACKWARD, i))]
            else:
                needs = [(rank, Action(ActionKind.FORWARD, i))]
                needs += [(rank + 1, action)] if rank < num_stages - 1 else []
            ticks[(rank, action)] = 1 + max([-1, *before, *(tick(*n) for n in needs)])
        return ticks[(rank, action)]

    for rank, row in enumerate(actions_per_stage):
        for action in row:
            tick(rank, action)
    return ticks


def oracle_grid(actions_per_stage: list[list[Action]]) -> list[list[Action | None]]:
    ticks = earliest_ticks(actions_per_stage)
    width = 1 + max(ticks.values())
    grid: list[list[Action | None]] = [[None] * width for _ in actions_per_stage]
    for (rank, action), t in ticks.items():
        assert grid[rank][t] is None, f"rank {rank} runs two actions at tick {t}"
        grid[rank][t] = action
    return grid


def test_oracle_agrees_with_hand_computed_grids() -> None:
    """The oracle itself, against grids worked out by hand (so it is not circular)."""
    assert format_grid(oracle_grid(plan("gpipe", 3, 2))) == (
        "rank 0 | F0 F1 .  .  .  .  B0 B1\n"
        "rank 1 | .  F0 F1 .  .  B0 B1 .\n"
        "rank 2 | .  .  F0 F1 B0 B1 .  ."
    )
    assert format_grid(oracle_grid(plan("1f1b", 3, 3))) == (
        "rank 0 | F0 F1 F2 .  .  B0 .  B1 .  B2\n"
        "rank 1 | .  F0 F1 .  B0 F2 B1 .  B2 .\n"
        "rank 2 | .  .  F0 B0 F1 B1 F2 B2 .  ."
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_stages", range(1, 6))
@pytest.mark.parametrize("num_microbatches", range(1, 10))
def test_schedules_validate_without_deadlock(
    schedule: str, num_stages: int, num_microbatches: int
) -> None:
    """validate and simulate each give the oracle's grid: every action in its rank's order,
    after what it depends on (strictly earlier ticks) and at the earliest such tick."""
    actions = plan(schedule, num_stages, num_microbatches)
    expected = oracle_grid(actions)
    assert validate(actions, num_microbatches) == expected
    assert simulate(actions) == expected
    p, m = num_stages, num_microbatches
    for rank, row in enumerate(expected):
        assert [a for a in row if a is not None] == actions[rank]
        in_flight = max_in_flight_of(actions[rank])
        if schedule in ("1f1b", "interleaved-1f1b"):  # interleaved with one chunk: 1F1B
            assert in_flight == min(p - rank, m)
        elif schedule == "zb-h1":
            assert in_flight <= min(2 * p - rank - 1, m)
            assert awaiting_backward(actions[rank]) <= min(p - rank, m)  # 1F1B's bound
        else:
            assert in_flight == m
    if schedule == "zb-h1":
        # Three unit actions per micro-batch (F, B, W) against 1F1B's F and a two-tick B:
        # the bubble is p - 1 ticks, a third of 1F1B's, once there are p micro-batches.
        ticks = len(expected[0])
        assert ticks == 3 * m + p - 1 if m >= p else ticks <= 3 * (m + p - 1)
    else:
        # Both finish in 2(m + p - 1) ticks when every action takes one.
        assert len(expected[0]) == 2 * (m + p - 1)


def awaiting_backward(actions: list[Action]) -> int:
    """The most micro-batches forwarded and not yet through ``B``."""
    forwarded = backed = most = 0
    for action in actions:
        forwarded += action.kind is ActionKind.FORWARD
        backed += action.kind is ActionKind.BACKWARD
        most = max(most, forwarded - backed)
    return most


def test_zb_h1_lists_and_bubble() -> None:
    """Every backward split, W filling the waits: p=4, m=8 takes 3m + p - 1 = 27 ticks, a
    bubble of 3 / 27 per stage against 1F1B's 9 / 33 (its B two ticks)."""
    actions = plan("zb-h1", 4, 8)
    for row in actions:
        assert sorted(str(a) for a in row if a.kind is ActionKind.WEIGHT) == sorted(
            f"W{i}" for i in range(8)
        )
    assert actions[3][:6] == parse_all("F0 B0 F1 B1 F2 B2")
    assert actions[0][:4] == parse_all("F0 F1 F2 F3")
    grid = simulate(actions)
    assert len(grid[0]) == 27
    assert bubble_fraction(grid) == pytest.approx(3 / 27)
    assert ideal_bubble("zb-h1", num_stages=4, num_microbatches=8) == pytest.approx(3 / 27)
    for name in ("gpipe", "1f1b"):
        assert ideal_bubble(name, num_stages=4, num_microbatches=8) == pytest.approx(3 / 11)


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([["F0", "W0", "B0"]], r"rank 0: W0 comes before B0"),
        ([["F0", "B0", "W0", "W0"]], r"rank 0: W0 appears more than once"),
        ([["W0"]], r"rank 0: W0 comes before B0"),
    ],
)
def test_validate_weight_errors(stages: list[list[str]], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        validate([[Action.parse(t) for t in row] for row in stages], 1)


def test_weight_pass_in_a_forward_only_schedule_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="backward action W0 in a forward-only"):
        validate([parse_all("F0 W0")], 1, training=False)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_fraction_p4_m8(schedule: str) -> None:
    """Both schedules take 2 * (m + p - 1) = 22 unit ticks for p=4, m=8.

    Each stage is busy for 2m = 16 ticks (m forwards + m backwards, one tick each), so the
    bubble fraction is 2(p - 1) / (2(m + p - 1)) = (p - 1) / (m + p - 1) = 3/11, the textbook
    figure. 1F1B does not shrink the bubble when F and B cost the same; it bounds activation
    memory (max_in_flight_of) instead.
    """
    num_stages, num_microbatches = 4, 8
    grid = simulate(plan(schedule, num_stages, num_microbatches))
    assert all(len(row) == 2 * (num_microbatches + num_stages - 1) for row in grid)
    expected = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert bubble_fraction(grid) == pytest.approx(expected)


def test_format_grid() -> None:
    grid = simulate([parse_all("F0 F1 B0 B1"), parse_all("F0 B0 F1 B1")])
    assert format_grid(grid) == "rank 0 | F0 F1 .  B0 .  B1\nrank 1 | .  F0 B0 F1 B1 ."
    assert format_grid([]) == ""
    assert bubble_fraction([]) == 0.0


def test_forward_only() -> None:
    actions = forward_only_actions(3)
    assert actions == parse_all("F0 F1 F2")
    grid = validate([actions, actions], 3, training=False)
    assert format_grid(grid) == "rank 0 | F0 F1 F2 .\nrank 1 | .  F0 F1 F2"
    with pytest.raises(InvalidArgumentError, match=r"rank 1: backward action B0"):
        simulate([actions, parse_all("F0 B0")], training=False)


def test_reversed_backwards_across_stages_is_a_deadlock() -> None:
    stages = [parse_all("F0 B0 F1 B1"), parse_all("F0 F1 B1 B0")]
    with pytest.raises(InvalidArgumentError) as info:
        validate(stages, 2)
    message = str(info.value)
    assert "deadlock" in message
    assert "rank 0 waits to run B0, which needs rank 1's B0" in message
    assert "rank 1 waits to run F1, which needs rank 0's F1" in message
    assert "rank 0 | F0 .\nrank 1 | .  F0" in message, "the grid so far"


def test_backward_before_forward() -> None:
    stages = [parse_all("B0 F0"), parse_all("F0 B0")]
    with pytest.raises(InvalidArgumentError, match=r"rank 0: B0 comes before F0"):
        validate(stages, 1)
    with pytest.raises(InvalidArgumentError, match="deadlock") as info:
        simulate(stages)
    assert "rank 0 waits to run B0, which needs its own F0 (later in its list)" in str(info.value)


def test_missing_upstream_action_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match=r"rank 1's B1 \(never scheduled there\)"):
        simulate([parse_all("F0 F1 B0 B1"), parse_all("F0 F1 B0")])


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([["F0", "B0"], ["F0"]], r"rank 1: missing B0"),
        ([["F0", "F0", "B0"]], r"rank 0: F0 appears more than once"),
        ([["F0", "F1", "B0", "B1"]], r"rank 0: F1 is out of range for num_microbatches \(1\)"),
        ([], "at least one stage"),
    ],
)
def test_validate_errors(stages: list[list[str]], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        validate([[Action.parse(t) for t in row] for row in stages], 1)


def test_stage_actions_argument_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'zb'.*gpipe, 1f1b, zb-h1"):
        stage_actions("zb", rank=0, num_stages=2, num_microbatches=2)
    with pytest.raises(InvalidArgumentError, match=r"rank \(2\) must be in \[0, 2\)"):
        stage_actions("1f1b", rank=2, num_stages=2, num_microbatches=2)
    with pytest.raises(InvalidArgumentError, match=r"num_stages \(0\)"):
        stage_actions("gpipe", rank=0, num_stages=0, num_microbatches=2)
    with pytest.raises(InvalidArgumentError, match=r"num_microbatches \(0\)"):
        stage_actions("gpipe", rank=0, num_stages=1, num_microbatches=0)
    with pytest.raises(InvalidArgumentError, match=r"num_microbatches \(0\)"):
        forward_only_actions(0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(1, 1), (2, 8), (4, 3), (4, 8)])
def test_max_in_flight_is_what_the_schedule_keeps(
    schedule: str, num_stages: int, num_microbatches: int
) -> None:
    for rank in range(num_stages):
        actions = stage_actions(
            schedule, rank=rank, num_stages=num_stages, num_microbatches=num_microbatches
        )
        assert max_in_flight(
            schedule, rank=rank, num_stages=num_stages, num_microbatches=num_microbatches
        ) == max_in_flight_of(actions)


@pytest.mark.parametrize("num_stages", range(2, 6))
@pytest.mark.parametrize("virtual_stages", (2, 3))
@pytest.mark.parametrize("num_microbatches", range(1, 13))
def test_interleaved_runs_every_chunk_without_deadlock(
    num_stages: int, virtual_stages: int, num_microbatches: int
) -> None:
    """Every rank runs F and B of every (micro-batch, chunk) once, the dry run finishes (the
    wrap from the last stage's chunk c to the first stage's chunk c + 1 included), and a rank
    keeps at most Megatron's warm-up plus one chunks of activations."""
    p, v, m = num_stages, virtual_stages, num_microbatches
    actions = all_stage_actions(
        "interleaved-1f1b", num_stages=p, num_microbatches=m, virtual_stages=v
    )
    grid = validate(actions, m)
    for rank, row in enumerate(grid):
        assert [a for a in row if a is not None] == actions[rank]
        assert {(a.microbatch_index, a.chunk) for a in actions[rank]} == {
            (i, c) for i in range(m) for c in range(v)
        }
        cap = min(v * m, 2 * (p - rank - 1) + (v - 1) * p + 1)
        assert max_in_flight_of(actions[rank]) <= cap
        assert max_in_flight(
            "interleaved-1f1b", rank=rank, num_stages=p, num_microbatches=m, virtual_stages=v
        ) == max_in_flight_of(actions[rank])
    ideal = ideal_bubble("interleaved-1f1b", num_stages=p, num_microbatches=m, virtual_stages=v)
    one_f_one_b = ideal_bubble("1f1b", num_stages=p, num_microbatches=m)
    assert ideal <= one_f_one_b
    if m % p == 0:  # Megatron's case: the bubble is V times smaller in time
        assert ideal == pytest.approx((p - 1) / (v * m + p - 1))


def test_a_chunk_waits_for_the_wrap_from_the_last_stage() -> None:
    """The first stage's chunk 1 needs the last stage's chunk 0: a list that runs it first
    deadlocks, and the message names the wait."""
    lists = all_stage_actions(
        "interleaved-1f1b", num_stages=2, num_microbatches=2, virtual_stages=2
    )
    first = [Action.parse("F0@1"), *[a for a in lists[0] if str(a) != "F0@1"]]
    with pytest.raises(
        InvalidArgumentError, match=r"rank 0 waits to run F0@1, which needs rank 1's F0"
    ):
        validate([first, lists[1]], 2)


def test_virtual_stages_need_an_interleaving_schedule() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"virtual_stages \(2\) needs one of \['interleaved-1f1b'\]"
    ):
        stage_actions("1f1b", rank=0, num_stages=2, num_microbatches=4, virtual_stages=2)
    with pytest.raises(InvalidArgumentError, match=r"virtual_stages \(0\) must be at least 1"):
        stage_actions(
            "interleaved-1f1b", rank=0, num_stages=2, num_microbatches=4, virtual_stages=0
        )


def test_chunked_actions_print_and_parse_back() -> None:
    for text in ("F0", "B12@1", "W3@2"):
        assert str(Action.parse(text)) == text
    for bad in ("F0@0", "F0@", "F0@01"):
        with pytest.raises(InvalidArgumentError):
            Action.parse(bad)
    assert forward_only_actions(2, chunks=2) == [
        Action.parse(t) for t in ("F0", "F1", "F0@1", "F1@1")
    ]
