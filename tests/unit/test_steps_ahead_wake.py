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
    """Done once ``ready`` is set; counts its calls, says whether the calls were still out
    when it was done; ``wake`` rings gather."""

    def __init__(self, calls: list[futures.Future[str]]) -> None:
        self.ready = threading.Event()
        self.first_call = threading.Event()
        self.done = threading.Event()
        self.calls = 0
        self.done_at: float | None = None
        self.out_when_done = False
        self.wake: Callable[[], None] | None = None
        self.watching: list[bool] = []
        self._gathered = calls

    def watch(self, wake: Callable[[], None] | None) -> None:
        self.wake = wake
        self.watching.append(wake is not None)

    def __call__(self) -> bool:
        self.calls += 1
        self.first_call.set()
        if not self.ready.is_set():
            return False
        self.done_at = time.monotonic()
        self.out_when_done = not any(call.done() for call in self._gathered)
        self.done.set()
        return True


def _calls() -> list[futures.Future[str]]:
    return [futures.Future(), futures.Future()]


def _end(calls: list[futures.Future[str]]) -> None:
    for number, call in enumerate(calls):
        if not call.done():
            call.set_result(f"reply {number}")


def test_meanwhile_runs_first_and_when_woken_while_the_calls_are_out() -> None:
    calls = _calls()
    meanwhile = _Meanwhile(calls)

    def later() -> None:
        try:
            assert meanwhile.first_call.wait(timeout=5)
            meanwhile.ready.set()
            assert meanwhile.wake is not None
            meanwhile.wake()
            meanwhile.done.wait(timeout=5)
        finally:
            _end(calls)

    helper = threading.Thread(target=later)
    helper.start()
    replies = gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile)
    helper.join()
    assert replies == ["reply 0", "reply 1"]
    assert meanwhile.calls == 2, "called first, then once for the wake"
    assert meanwhile.out_when_done, "done when woken, not only when the calls ended"
    assert meanwhile.watching[0] and not meanwhile.watching[-1], "watched, then let go"


def test_a_wake_after_meanwhile_is_done_does_not_spin_the_wait() -> None:
    """The reader goes on preparing steps (each rings) after the next one went ahead: the
    wait sleeps through them instead of looping."""
    calls = _calls()
    stray: list[Callable[[], None]] = []

    def later() -> None:
        try:
            meanwhile.done.wait(timeout=5)
            for _ in range(300):
                for wake in stray:
                    wake()
                time.sleep(0.001)
        finally:
            _end(calls)

    class KeepsItsWake(_Meanwhile):
        def watch(self, wake: Callable[[], None] | None) -> None:
            if wake is not None:
                stray.append(wake)  # a reader that still holds the wake it was given
            super().watch(wake)

    meanwhile = KeepsItsWake(calls)
    meanwhile.ready.set()  # done at its first call
    helper = threading.Thread(target=later)
    helper.start()
    cpu = time.thread_time()
    gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile)
    cpu = time.thread_time() - cpu
    helper.join()
    assert meanwhile.calls == 1
    assert cpu < 0.15, f"the wait used {cpu:.2f} s of CPU over about 0.4 s"


def test_meanwhile_gets_its_turn_when_every_reply_is_in_already() -> None:
    """A short run can end before its caller waits for it: the step is still undecided, so
    the next one may still go ahead."""
    calls = _calls()
    _end(calls)
    meanwhile = _Meanwhile(calls)
    meanwhile.ready.set()
    assert gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile) == ["reply 0", "reply 1"]
    assert meanwhile.calls == 1


def test_nothing_goes_ahead_of_a_run_known_to_have_failed() -> None:
    calls = _calls()
    calls[0].set_exception(StageUnavailableError("stage a went away"))
    meanwhile = _Meanwhile(calls)
    meanwhile.ready.set()
    with pytest.raises(StageUnavailableError, match="went away"):
        gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile)
    assert meanwhile.calls == 0
    _end(calls)


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

    meanwhile = WokenWhileItRuns(calls)
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

    meanwhile = Fails(calls)
    with pytest.raises(StageUnavailableError, match="ahead failed"):
        gather(NO_REGISTRY, PLAN, calls, meanwhile=meanwhile)
    assert meanwhile.watching == [True, False]
    _end(calls)


class _Step:
    """A step that records what it saw of the next one while it ran; ``looked`` is set once
    the first step found no next one."""

    looked = threading.Event()

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
        if self.name == "first":
            _Step.looked.set()
            if first is None and woken.wait(timeout=5):
                later = ahead()
                self.saw.append(None if later is None else later.name)
        ahead.watch(None)
        return self.name

    def end(self) -> None:
        pass


def test_a_stream_wakes_the_running_step_when_it_prepares_the_next() -> None:
    steps: dict[str, _Step] = {}
    _Step.looked.clear()

    def requests() -> Iterator[str]:
        yield "first"
        assert _Step.looked.wait(timeout=5)  # comes while the first runs, after its look
        yield "second"

    stream: TrainStream[str, str, str] = TrainStream(
        requests(), prepare=lambda name: _Step(name, steps), reply=lambda result: result
    )
    assert list(stream.replies()) == ["first", "second"]
    assert steps["first"].saw == [None, "second"], "not woken when the second was prepared"


def test_upcoming_map_sees_the_same_step_and_shares_the_watch() -> None:
    watched: list[object] = []
    upcoming: Upcoming[int] = Upcoming(lambda: 3, watched.append)
    doubled = upcoming.map(lambda n: n * 2 if n > 2 else None)
    assert doubled() == 6
    assert upcoming.map(lambda n: None)() is None
    doubled.watch(print)
    assert watched == [print]
