"""A job's step lines: one at INFO per interval with the steps and rate since the last, the
rest at DEBUG ([Note: step lines])."""

from __future__ import annotations

import logging

import pytest

from pipesvc.observe.step_lines import StepLines

LOGGER = "test.step_lines"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_line_per_interval_with_the_steps_and_rate_since_the_last(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    lines = StepLines(logging.getLogger(LOGGER), "j1", every_s=10.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for step in range(1, 2001):  # 128 steps a second (an exact binary fraction)
            lines.committed(step, 1.0 / step)
            clock.now += 1 / 128
    info = _lines(caplog, logging.INFO)
    # The first step's line, then one when 10 s have passed: 1280 steps later.
    assert info == [
        "job j1: step 1 committed, loss 1.000000",
        "job j1: step 1281 committed, loss 0.000781 (1280 steps in 10.0 s, 128.00 steps/s)",
    ]
    # Every other step is logged at DEBUG, none twice and none lost.
    assert len(_lines(caplog, logging.DEBUG)) == 2000 - len(info)
    context = [(r.__dict__["job"], r.__dict__["step"]) for r in caplog.records]
    assert context == [("j1", step) for step in range(1, 2001)]


def test_slow_steps_each_get_a_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    lines = StepLines(logging.getLogger(LOGGER), "j2", every_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for step in range(1, 4):
            lines.committed(step, 0.5)
            clock.now += 12.0
    assert _lines(caplog, logging.INFO) == [
        "job j2: step 1 committed, loss 0.500000",
        "job j2: step 2 committed, loss 0.500000 (1 steps in 12.0 s, 0.08 steps/s)",
        "job j2: step 3 committed, loss 0.500000 (1 steps in 12.0 s, 0.08 steps/s)",
    ]


def test_a_step_behind_the_last_line_is_logged_without_a_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After an older state is loaded the step counter goes back: no negative rate."""
    clock = Clock()
    lines = StepLines(logging.getLogger(LOGGER), "j3", every_s=1.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        lines.committed(50, 0.25)
        clock.now += 2.0
        lines.committed(11, 0.75)
    assert _lines(caplog, logging.INFO) == [
        "job j3: step 50 committed, loss 0.250000",
        "job j3: step 11 committed, loss 0.750000",
    ]
