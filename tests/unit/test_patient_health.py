"""The health check before a call and after a failed one (``patient_health``) takes a stage for
lost only after ``health_failures`` unanswered checks in a row, ``health_interval_s`` apart, as
the watchdog does during a call (one miss used to be enough), or at once when the stage is gone
(its connection refused or closed)."""

from __future__ import annotations

from typing import cast

import pytest

from pipesvc.coordinator.stage_calls import Deadlines, patient_health
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.core.health import Health

S, U, N = Health.SERVING, Health.UNREACHABLE, Health.NOT_SERVING
GONE = "gone"
"""A check that found the stage gone: refused or closed, not left unanswered."""
Answer = Health | str


class _Answers:
    """A registry seam: each address answers its checks in the order given, then as the last."""

    def __init__(self, answers: dict[str, list[Answer]]) -> None:
        self._answers = {a: iter(h) for a, h in answers.items()}
        self._last = {a: h[-1] for a, h in answers.items()}
        self.checks: list[tuple[str, float]] = []

    def health_check(self, address: str, timeout_s: float) -> tuple[Health, bool]:
        self.checks.append((address, timeout_s))
        answer = next(self._answers[address], self._last[address])
        return (U, True) if answer == GONE else (Health(answer), False)


def _check(
    answers: dict[str, list[Answer]], failures: int
) -> tuple[dict[str, Health], _Answers, list[float]]:
    registry = _Answers(answers)
    slept: list[float] = []
    deadlines = Deadlines(health_failures=failures, health_interval_s=0.7, health_s=0.3)
    found = patient_health(
        cast(StageRegistry, registry), list(answers), deadlines, sleep=slept.append
    )
    return found, registry, slept


def _count(registry: _Answers, address: str) -> int:
    return sum(a == address for a, _ in registry.checks)


def test_a_stage_that_misses_fewer_checks_than_the_limit_is_not_lost() -> None:
    found, registry, slept = _check({"a": [U, U, S], "b": [S]}, failures=3)
    assert found == {"a": S, "b": S}
    assert _count(registry, "a") == 3
    assert _count(registry, "b") == 1  # only a stage that missed is checked again
    assert slept == [0.7, 0.7]
    assert {t for _, t in registry.checks} == {0.3}


def test_a_stage_that_misses_every_check_is_lost_after_exactly_the_limit() -> None:
    found, registry, slept = _check({"a": [U], "b": [S]}, failures=4)
    assert found == {"a": U, "b": S}
    assert _count(registry, "a") == 4
    assert slept == [0.7] * 3


def test_a_later_answer_is_the_status_even_when_not_serving() -> None:
    found, _, _ = _check({"a": [U, N]}, failures=2)
    assert found == {"a": N}  # a leaving stage that answered: migrated, not replaced


def test_one_failure_allowed_checks_once_and_never_waits() -> None:
    found, registry, slept = _check({"a": [U, S]}, failures=1)
    assert found == {"a": U}
    assert _count(registry, "a") == 1
    assert slept == []


def test_every_stage_serving_is_one_round_with_no_wait() -> None:
    found, registry, slept = _check({"a": [S], "b": [S], "c": [N]}, failures=5)
    assert found == {"a": S, "b": S, "c": N}
    assert len(registry.checks) == 3
    assert slept == []


@pytest.mark.parametrize("failures", [2, 3])
def test_stages_that_come_back_at_different_checks(failures: int) -> None:
    answers: dict[str, list[Answer]] = {"a": [U, S], "b": [U, U, S], "c": [U]}
    found, registry, _ = _check(answers, failures)
    assert found["a"] == S
    assert found["b"] == (S if failures >= 3 else U)
    assert found["c"] == U
    assert _count(registry, "c") == failures


def test_a_stage_found_gone_is_lost_at_once_while_a_silent_one_is_waited_for() -> None:
    found, registry, slept = _check({"a": [GONE, S], "b": [U, S], "c": [S]}, failures=3)
    assert found == {"a": U, "b": S, "c": S}
    assert _count(registry, "a") == 1  # refused: no process listens there, nothing to wait for
    assert _count(registry, "b") == 2
    assert slept == [0.7]


def test_a_stage_that_stops_answering_and_then_refuses_is_lost_then() -> None:
    found, registry, slept = _check({"a": [U, GONE, S]}, failures=5)
    assert found == {"a": U}
    assert _count(registry, "a") == 2
    assert slept == [0.7]
