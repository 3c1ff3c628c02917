"""The checkpoint cadence: fixed intervals as named, cost-set ones within their budget."""

from __future__ import annotations

import itertools

import pytest

from pipesvc.core.cadence import (
    AUTO_MAX_INTERVAL_S,
    AUTO_MIN_STEPS,
    AUTO_OVERHEAD,
    CheckpointCadence,
)


def run(cadence: CheckpointCadence, steps: int, step_s: float, cost_s: float) -> list[int]:
    """Trains ``steps`` steps of ``step_s``; each checkpoint asked for costs ``cost_s``."""
    taken = []
    for step in range(1, steps + 1):
        cadence.step_took(step_s)
        if cadence.due(step):
            cadence.asked(step)
            cadence.checkpointed(step, cost_s)
            taken.append(step)
    return taken


@pytest.mark.parametrize("every", [1, 3, 10])
def test_fixed_interval_is_exact_whatever_the_cost(every: int) -> None:
    taken = run(CheckpointCadence(every), 40, step_s=0.01, cost_s=5.0)
    assert taken == list(range(every, 41, every))


def test_zero_takes_none() -> None:
    assert run(CheckpointCadence(0), 50, step_s=0.01, cost_s=0.0) == []


def test_cheap_checkpoints_keep_the_shortest_interval() -> None:
    taken = run(CheckpointCadence(None), 55, step_s=0.1, cost_s=0.001)
    assert taken == [10, 20, 30, 40, 50]


@pytest.mark.parametrize(("step_s", "cost_s"), [(0.014, 0.012), (0.04, 0.1), (0.2, 0.5)])
def test_costly_checkpoints_stay_within_the_budget(step_s: float, cost_s: float) -> None:
    steps = 5000
    taken = run(CheckpointCadence(None), steps, step_s=step_s, cost_s=cost_s)
    assert taken[0] == AUTO_MIN_STEPS
    gaps = {b - a for a, b in itertools.pairwise(taken)}
    assert len(gaps) == 1 and gaps.pop() > AUTO_MIN_STEPS
    # After the first (which comes before any cost is known), the share stays in budget and
    # the interval is the shortest that does.
    later = taken[1:]
    gap = later[1] - later[0]
    assert cost_s / (gap * step_s) <= AUTO_OVERHEAD
    assert cost_s / ((gap - 1) * step_s) > AUTO_OVERHEAD


def test_interval_is_capped_in_training_time() -> None:
    step_s = 10.0
    taken = run(CheckpointCadence(None), 2000, step_s=step_s, cost_s=600.0)
    gap = taken[2] - taken[1]
    assert gap == AUTO_MAX_INTERVAL_S // step_s


def test_interval_follows_the_step_time() -> None:
    cadence = CheckpointCadence(None)
    run(cadence, 10, step_s=0.01, cost_s=0.1)
    assert cadence.interval == 500
    for _ in range(200):  # steps get 10x longer: the mean follows
        cadence.step_took(0.1)
    cadence.checkpointed(300, 0.1)
    assert cadence.interval == 50


def test_restart_counts_from_the_last_checkpoint() -> None:
    cadence = CheckpointCadence(None, start_step=37)
    assert not cadence.due(46)
    assert cadence.due(47)
