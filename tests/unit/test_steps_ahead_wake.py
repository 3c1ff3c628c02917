"""The parts that let a stream's next step go ahead when it arrives while the running step's
run is out (see [Note: steps ahead] in pipesvc/coordinator/step_runner.py): ``gather`` does its
``meanwhile`` as it is woken, and a ``TrainStream`` wakes the running step when it prepares the
next one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, cast

import pytest

from pipesvc.coordinator.stage_calls import gather
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.coordinator.train_stream import TrainStream, Upcoming
from pipesvc.core.plan import PipelineStage
from pipesvc.errors import StageUnavailableError

PLAN = [
    PipelineStage(start_layer=0, end_layer=1, rank=0, address="a:1"),
    PipelineStage(start_layer=1, end_layer=2, rank=1, address="b:1"),
]
NO_REGISTRY = cast(StageRegistry, None)  # used only by the health watchdog, off here


class _Meanwhile:
    """Done once ``ready`` is set; counts its calls; ``wake`` rings gather."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.calls = 0
        self.done_at: float | None = None
        self.wake: Callable[[], None] | None = None
        self.watching: list[bool] = []

    def watch(self, wake: Callable[[], None] | None) -> None:
        self.wake = wake
        self.watching.append(wake is not None)

    def __call__(self) -> bool:
        self.calls += 1
        if not self.ready.is_set():
            return False
        self.done_at = time.monotonic()
        return True


def _calls() -> list[futures.Future[str]]:
    return [futures.Future(), futures.Future()]


def test_meanwhile_runs_first_and_when_woken_while_the_calls_are_out() -> None:
    calls, meanwhile = _calls(), _Meanwhile()
    woken_at: list[float] = []

    def later() -> None:
        time.sleep(0.05)
        meanwhile.ready.set()
        woken_at.append(time.monotonic())
        assert meanwhile.wake is not None
        meanwhile.wake()
        time.sleep(0.05)
        for number, call in enumerate(calls):
            call.set_result(f"reply {number}")

    helper = threading.Thread(target=later)
    helper.start()
    replies = gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile)
    helper.join()
    assert replies == ["reply 0", "reply 1"]
    assert meanwhile.calls == 2, "called first, then once for the wake"
    assert meanwhile.done_at is not None and meanwhile.done_at - woken_at[0] < 0.04, (
        "done as soon as woken, not when the calls ended"
    )
    assert meanwhile.watching == [True, False], "watched while gathering, then let go"


def test_a_wake_between_a_call_and_the_wait_is_not_lost() -> None:
    """The wake comes while ``meanwhile`` runs, after it found nothing to do (as a step
    prepared just after the look): gather calls it again at once instead of sleeping through
    it until the calls end."""
    calls = _calls()

    class WokenWhileItRuns(_Meanwhile):
        def __call__(self) -> bool:
            done = super().__call__()
            if self.calls == 1:
                assert not done and self.wake is not None
                self.ready.set()
                self.wake()  # rung before gather waits
            elif done:
                for call in calls:
                    if not call.done():
                        call.set_result("reply")
            return done

    meanwhile = WokenWhileItRuns()
    safety = threading.Timer(5.0, lambda: [c.set_result("late") for c in calls if not c.done()])
    safety.start()
    started = time.monotonic()
    try:
        assert gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile) == ["reply", "reply"]
    finally:
        safety.cancel()
    assert meanwhile.calls == 2
    assert meanwhile.done_at is not None and meanwhile.done_at - started < 1.0


def test_what_meanwhile_raises_ends_the_gather() -> None:
    calls = _calls()

    class Fails(_Meanwhile):
        def __call__(self) -> bool:
            raise StageUnavailableError("sending the run ahead failed")

    meanwhile = Fails()
    with pytest.raises(StageUnavailableError, match="ahead failed"):
        gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile)
    assert meanwhile.watching == [True, False]


class _Step:
    """A step that records what it saw of the next one while it ran."""

    def __init__(self, name: str, steps: dict[str, _Step]) -> None:
        self.name = name
        self.saw: list[str | None] = []
        steps[name] = self

    def __call__(self, ahead: Upcoming[Any] | None) -> str:
        assert ahead is not None
        woken = threading.Event()
        ahead.watch(woken.set)
        first = ahead()
        self.saw.append(None if first is None else first.name)
        if first is None and self.name == "first" and woken.wait(timeout=5):
            later = ahead()
            self.saw.append(None if later is None else later.name)
        ahead.watch(None)
        return self.name

    def end(self) -> None:
        pass


def test_a_stream_wakes_the_running_step_when_it_prepares_the_next() -> None:
    steps: dict[str, _Step] = {}
    second_may_come = threading.Event()

    def requests() -> Iterator[str]:
        yield "first"
        second_may_come.wait(timeout=5)
        yield "second"

    def prepare(name: str) -> _Step:
        if name == "second":
            time.sleep(0.02)  # arrives while the first runs
        return _Step(name, steps)

    stream: TrainStream[str, str, str] = TrainStream(
        requests(), prepare=prepare, reply=lambda result: result
    )
    replies = stream.replies()
    second_may_come.set()
    assert list(replies) == ["first", "second"]
    assert steps["first"].saw == [None, "second"], "not woken when the second was prepared"


def test_upcoming_map_sees_the_same_step_and_shares_the_watch() -> None:
    watched: list[object] = []
    upcoming: Upcoming[int] = Upcoming(lambda: 3, watched.append)
    doubled = upcoming.map(lambda n: n * 2 if n > 2 else None)
    assert doubled() == 6
    assert upcoming.map(lambda n: None)() is None
    doubled.watch(print)
    assert watched == [print]
