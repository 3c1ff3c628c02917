"""``StepStream`` against a fake ``Train`` call: losses in order, unreplied steps sent again
under their request ids after a lost call (each applied once), a bad batch raised at its step
with nothing after it sent, a coordinator's error raised after the losses before it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from pipesvc.errors import InvalidArgumentError, PipesvcError, StageUnavailableError
from pipesvc.v1 import coordinator_pb2
from pipesvc.wire.step_stream import StepStream


class _Lost(grpc.RpcError):
    def __init__(self, retry: bool) -> None:
        self.retry = retry


class _Coordinator:
    """Applies each request id once (a repeat gets its first result) and fails a call after
    ``fail_after`` replies, with the step of the failing reply applied or not."""

    def __init__(self, fail_after: int | None = None, *, applied: bool = True, retry: bool = True):
        self.fail_after = fail_after
        self.applied_before_failing = applied
        self.retry = retry
        self.results: dict[str, tuple[int, float]] = {}
        self.applied: list[str] = []
        self.calls = 0

    def open(self, requests: Iterator[coordinator_pb2.TrainStepRequest]) -> _Call:
        self.calls += 1
        return _Call(self, requests, fail=self.fail_after if self.calls == 1 else None)

    def apply(self, request: coordinator_pb2.TrainStepRequest) -> coordinator_pb2.TrainStepResponse:
        if request.request_id not in self.results:
            self.applied.append(request.request_id)
            step = len(self.applied)
            self.results[request.request_id] = (step, float(request.job_id))
        step, loss = self.results[request.request_id]
        return coordinator_pb2.TrainStepResponse(loss=loss, step=step)


class _Call:
    def __init__(
        self,
        coordinator: _Coordinator,
        requests: Iterator[coordinator_pb2.TrainStepRequest],
        fail: int | None,
    ) -> None:
        self.coordinator, self.requests, self.fail, self.replied = coordinator, requests, fail, 0

    def __iter__(self) -> _Call:
        return self

    def __next__(self) -> coordinator_pb2.TrainStepResponse:
        request = next(self.requests)  # StopIteration: the client half-closed
        if self.fail is not None and self.replied == self.fail:
            if self.coordinator.applied_before_failing:
                self.coordinator.apply(request)  # decided, its reply lost
            raise _Lost(self.coordinator.retry)
        self.replied += 1
        return self.coordinator.apply(request)

    def cancel(self) -> None:
        pass


def _stream(coordinator: _Coordinator, batches: Iterator[int], **kw: object) -> StepStream:
    def make_request(batch: int) -> coordinator_pb2.TrainStepRequest:
        if batch < 0:
            raise InvalidArgumentError(f"batch {batch} is bad")
        return coordinator_pb2.TrainStepRequest(job_id=str(batch), request_id=f"id-{batch}")

    replies: list[int] = kw.pop("replies", [])  # type: ignore[assignment]
    open_call = kw.pop("open_call", coordinator.open)
    return StepStream(
        batches,
        make_request=make_request,
        open_call=open_call,  # type: ignore[arg-type]
        on_reply=lambda reply: replies.append(reply.step),
        convert=lambda error: StageUnavailableError("lost"),
        retryable=lambda error, progressed: isinstance(error, _Lost) and error.retry,
        retries=2,
        pause_s=0.0,
    )


@pytest.mark.parametrize("applied", [True, False], ids=["reply-lost", "never-applied"])
def test_a_lost_call_sends_the_unreplied_steps_again_and_each_applies_once(applied: bool) -> None:
    coordinator = _Coordinator(fail_after=3, applied=applied)
    replies: list[int] = []
    losses = list(_stream(coordinator, iter(range(10)), replies=replies))
    assert losses == [float(i) for i in range(10)]
    assert coordinator.calls == 2
    assert coordinator.applied == [f"id-{i}" for i in range(10)]  # once each, in order
    assert replies == list(range(1, 11))


def test_a_bad_batch_is_raised_at_its_step_and_nothing_after_it_is_read() -> None:
    coordinator = _Coordinator()
    read: list[int] = []

    def batches() -> Iterator[int]:
        for batch in (0, 1, 2, -1, 4, 5):
            read.append(batch)
            yield batch

    losses: list[float] = []
    with pytest.raises(InvalidArgumentError, match="batch -1"):
        for loss in _stream(coordinator, batches()):
            losses.append(loss)
    assert losses == [0.0, 1.0, 2.0]
    assert coordinator.applied == ["id-0", "id-1", "id-2"]
    assert read == [0, 1, 2, -1]


def test_a_coordinator_error_is_raised_after_the_losses_before_it() -> None:
    coordinator = _Coordinator(fail_after=2, applied=False, retry=False)
    losses: list[float] = []
    with pytest.raises(PipesvcError, match="lost"):
        for loss in _stream(coordinator, iter(range(6))):
            losses.append(loss)
    assert losses == [0.0, 1.0]
    assert coordinator.calls == 1


def test_stopping_early_sends_nothing_more() -> None:
    coordinator = _Coordinator()
    replies: list[int] = []
    stream = iter(_stream(coordinator, iter(range(100)), replies=replies))
    assert [next(stream), next(stream)] == [0.0, 1.0]
    stream.close()  # type: ignore[attr-defined]
    assert coordinator.applied == ["id-0", "id-1"]
    assert replies == [1, 2]


class _PumpedCall:
    """A call whose requests are drawn on a thread of its own, as gRPC draws them; ``lose``
    makes the caller's next read fail in transport."""

    def __init__(
        self, coordinator: _Coordinator, requests: Iterator[coordinator_pb2.TrainStepRequest]
    ) -> None:
        self.sent: list[str] = []
        self._replies: queue.Queue[coordinator_pb2.TrainStepResponse | BaseException | None] = (
            queue.Queue()
        )
        self._coordinator, self._requests = coordinator, requests
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for request in self._requests:
            self.sent.append(request.request_id)
            self._replies.put(self._coordinator.apply(request))
        self._replies.put(None)  # half-closed: the coordinator ends the call

    def lose(self) -> None:
        self._replies.put(_Lost(retry=True))

    def __iter__(self) -> _PumpedCall:
        return self

    def __next__(self) -> coordinator_pb2.TrainStepResponse:
        item = self._replies.get(timeout=10)
        if item is None:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        pass


class _PumpedCalls:
    """Opens a ``_PumpedCall`` for each call a stream opens, counting them on the
    coordinator."""

    def __init__(self, coordinator: _Coordinator) -> None:
        self.coordinator = coordinator
        self.calls: list[_PumpedCall] = []
        self._cond = threading.Condition()

    def open(self, requests: Iterator[coordinator_pb2.TrainStepRequest]) -> _PumpedCall:
        with self._cond:
            self.coordinator.calls += 1
            self.calls.append(_PumpedCall(self.coordinator, requests))
            self._cond.notify_all()
            return self.calls[-1]

    def opened(self, count: int) -> bool:
        """Waits (up to 10 s) until ``count`` calls were opened."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.calls) >= count, timeout=10)


def test_a_batch_read_while_its_call_was_lost_goes_on_the_next_call_once() -> None:
    """The caller's batches are read on the sending thread of the call that asked for them;
    one read when that call is lost and another opened is sent on the new call."""
    coordinator = _Coordinator()
    pumped = _PumpedCalls(coordinator)

    def batches() -> Iterator[int]:
        yield from (0, 1)
        pumped.calls[0].lose()  # read on the first call's thread: that call fails meanwhile
        assert pumped.opened(2)
        time.sleep(0.1)  # the second call's thread now waits for this read
        yield 2

    stream = _stream(coordinator, batches(), open_call=pumped.open)
    assert list(stream) == [0.0, 1.0, 2.0]
    assert coordinator.applied == ["id-0", "id-1", "id-2"]
    calls = pumped.calls
    assert (calls[0].sent, calls[1].sent) == (["id-0", "id-1"], ["id-2"])


def test_stopping_while_the_next_batch_is_read_waits_only_for_the_steps_sent() -> None:
    """The caller stops while the sending thread is in its iterator (here, waiting for the
    caller itself): the stream ends once the steps sent have their replies, without waiting
    for that read or for the call's end."""
    coordinator = _Coordinator()
    reading, release = threading.Event(), threading.Event()

    def batches() -> Iterator[int]:
        yield from (0, 1, 2)
        reading.set()
        release.wait(timeout=30)  # the caller's loop would feed it; it stopped
        yield 3

    replies: list[int] = []
    stream = _stream(
        coordinator, batches(), replies=replies, open_call=_PumpedCalls(coordinator).open
    )
    losses = iter(stream)
    assert next(losses) == 0.0
    assert reading.wait(timeout=10)  # the sending thread is in the caller's iterator
    started = time.monotonic()
    losses.close()  # type: ignore[attr-defined]
    took = time.monotonic() - started
    release.set()
    assert took < 5, f"stopping waited {took:.1f} s for the caller's iterator"
    assert coordinator.applied == ["id-0", "id-1", "id-2"]  # every step sent, counted
    assert replies == [1, 2, 3]


class _Interrupt(BaseException):
    pass


def test_a_batch_that_raises_a_base_exception_is_raised_at_its_step() -> None:
    coordinator = _Coordinator()

    def batches() -> Iterator[int]:
        yield from (0, 1)
        raise _Interrupt

    stream = _stream(coordinator, batches(), open_call=_PumpedCalls(coordinator).open)
    losses: list[float] = []
    with pytest.raises(_Interrupt):
        for loss in stream:
            losses.append(loss)
    assert losses == [0.0, 1.0]
    assert coordinator.applied == ["id-0", "id-1"]
