"""The client's side of ``Train``: batches streamed ahead, losses read back in order.

``Job.train`` builds one ``StepStream`` (see [Note: pipelined steps] in
``pipesvc/coordinator/train_stream.py`` for the coordinator's side). The thread that gRPC
sends the call's requests from takes batches from the caller's iterable and encodes each into
a request with a fresh request id while earlier steps run, and sends it at once (no hand-over
to another thread); at most ``TRAIN_WINDOW`` requests are out without a reply, so the
coordinator always holds the next step when one is decided, and a caller that stops leaves at
most that many steps sent and unreplied.

[Note: stream reconnect] Each sent request is kept until its reply arrives. When the call
fails in transport (the coordinator restarted, the connection dropped) or reaches its deadline
after at least one reply (``timeout_s`` bounds a call, not a whole run of steps), a new call
sends the unreplied requests again, under their request ids, and then the rest: the
coordinator answers a step it decided with its first result and runs one it did not (see
[Note: step request ids] in ``pipesvc/coordinator/step_request.py``), so each step is applied
once and the losses come back in order. A call that fails with the coordinator's own error (a step
that failed) is not retried: that error is raised after the losses of the steps before it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

import grpc

from pipesvc.errors import InternalError, PipesvcError
from pipesvc.v1 import coordinator_pb2
from pipesvc.wire.payload_wire import Outgoing

TRAIN_WINDOW = 3
"""Steps sent ahead without a reply: the one running, the next (whose run the coordinator
sends to the stages before the running one is decided, see [Note: steps ahead] in
``pipesvc.coordinator.step_runner``) and the one after it, already on the coordinator
(decoded, checked, split) when the next one's run goes out."""

Request = Outgoing[coordinator_pb2.TrainStepRequest]
"""A step as sent: its message and its tensors' bytes beside it (see [Note: payload wire])."""
Reply = coordinator_pb2.TrainStepResponse


class StepStream:
    """Training steps over one or more ``Train`` calls; iterating it yields each step's loss.

    Args:
        batches: the caller's batches (read on gRPC's sending thread, a few ahead).
        make_request: a batch's request, with a new request id (raises for a bad batch; the
            error is raised once every step before it has yielded its loss).
        open_call: starts a ``Train`` call on an iterator of requests.
        on_reply: called with each reply before its loss is yielded.
        convert: the typed error of a failed call.
        retryable: whether a failed call is one to send the unreplied steps again on (its
            second argument: whether a reply arrived on that call).
        retries: calls opened again in a row without a reply in between before giving up.
        pause_s: pause before the first such call; doubles with each.
    """

    def __init__(
        self,
        batches: Iterator[Any],
        *,
        make_request: Callable[[Any], Request],
        open_call: Callable[[Iterator[Request]], Any],
        on_reply: Callable[[Reply], None],
        convert: Callable[[grpc.RpcError], PipesvcError],
        retryable: Callable[[grpc.RpcError, bool], bool],
        retries: int,
        pause_s: float,
        window: int = TRAIN_WINDOW,
    ) -> None:
        self._batches = batches
        self._make_request = make_request
        self._open_call = open_call
        self._on_reply = on_reply
        self._convert = convert
        self._retryable = retryable
        self._retries = retries
        self._pause_s = pause_s
        self._window = window
        self._cond = threading.Condition()
        self._ready: deque[Request] = deque()
        """Encoded, not sent yet (by a call that ended meanwhile)."""
        self._reading = False
        """A thread is reading the caller's next batch."""
        self._unreplied: deque[Request] = deque()
        """Sent on some call, without a reply yet, oldest first."""
        self._call_number = 0
        """Bumped by each call opened: an older call's request iterator stops sending."""
        self._exhausted = False
        """No batch comes after ``_ready``'s (the batches ran out, or one failed)."""
        self._error: BaseException | None = None
        """The failed batch's error, raised after the steps before it."""
        self._closed = False

    def __iter__(self) -> Iterator[float]:
        return self.losses()

    def losses(self) -> Generator[float, None, None]:
        """Each step's loss, in order (``close()`` stops sending; the steps sent finish)."""
        call = self._open()
        failures = 0
        progressed = False
        failed = True
        try:
            while not self._done():
                try:
                    reply = next(call)
                except StopIteration:
                    if self._done():
                        break
                    raise InternalError(
                        f"the coordinator ended the training stream with {len(self._unreplied)} "
                        "step(s) sent and unreplied"
                    ) from None
                except grpc.RpcError as error:
                    if failures >= self._retries or not self._retryable(error, progressed):
                        raise self._convert(error) from error
                    if not progressed:
                        time.sleep(self._pause_s * 2**failures)
                        failures += 1
                    call.cancel()
                    call = self._open()
                    progressed = False
                    continue
                failures, progressed = 0, True
                with self._cond:
                    self._unreplied.popleft()
                    self._cond.notify_all()
                self._on_reply(reply)
                yield float(reply.loss)
            failed = False
            if self._error is not None:
                raise self._error
        except GeneratorExit:
            failed = False  # the caller stopped: the steps already sent finish (see below)
            raise
        finally:
            with self._cond:
                self._closed = True  # nothing more is sent; the call is half-closed
                self._cond.notify_all()
            if not failed:
                self._drain(call)
            call.cancel()

    def _drain(self, call: Any) -> None:
        """Waits for the coordinator to end ``call``, once nothing more is sent: the steps it
        received finish (each commits whole, and ``on_reply`` counts it), and none starts
        after this returns, so the caller's next call sees the job as the stream left it. A
        failure ends the wait: a step's error (nothing after it runs), or the coordinator or
        the connection gone (a step the coordinator was running still commits whole or not at
        all, and is counted by the job's next reply).

        The call half-closes when its sending thread next asks for a request. If that thread
        is in the caller's iterator, which may take long or wait for this very loop, the wait
        ends instead once every step sent has its reply: nothing more is sent (``_closed``),
        and the call is then cancelled with no step of it running."""
        try:
            while True:
                with self._cond:
                    if self._reading and not self._unreplied:
                        return
                reply = next(call)
                with self._cond:
                    if self._unreplied:
                        self._unreplied.popleft()
                self._on_reply(reply)
        except (StopIteration, grpc.RpcError):
            pass

    def _done(self) -> bool:
        """Every batch there is has been replied to."""
        with self._cond:
            return self._exhausted and not self._ready and not self._unreplied

    def _open(self) -> Any:
        """A new call, which first sends the unreplied steps again (see [Note: stream
        reconnect])."""
        with self._cond:
            self._call_number += 1
            self._cond.notify_all()  # an older call's request iterator stops
            return self._open_call(self._requests(self._call_number, list(self._unreplied)))

    def _requests(self, number: int, resend: list[Request]) -> Iterator[Request]:
        """Call ``number``'s requests (consumed by gRPC on a thread of its own): ``resend``,
        then each batch, read and encoded on that thread once fewer than ``window`` steps are
        out without a reply; ends (half-closing the call) after the last batch."""
        yield from resend
        while True:
            request = self._next_request(number)
            if request is None:
                return
            yield request

    def _next_request(self, number: int) -> Request | None:
        """The next request for call ``number`` (None: the call is over, or the batches are):
        one encoded and not sent (by an older call's thread), or the next batch encoded here.
        One thread at a time reads the caller's batches."""
        while True:
            with self._cond:
                while True:
                    if number != self._call_number or self._closed:
                        return None
                    if self._ready:
                        request = self._ready.popleft()
                        self._unreplied.append(request)
                        self._cond.notify_all()
                        return request
                    if self._exhausted:
                        return None
                    if not self._reading and len(self._unreplied) < self._window:
                        self._reading = True
                        break
                    self._cond.wait()
            self._read_batch()

    def _read_batch(self) -> None:
        """Reads and encodes the next batch into ``_ready``, or marks the batches exhausted
        (keeping a failed batch's error for after the steps before it)."""
        error: BaseException | None = None
        request: Request | None = None
        try:
            request = self._make_request(next(self._batches))
        except StopIteration:
            pass
        except BaseException as exc:  # raised to the caller at this step, on its own thread
            error = exc
        with self._cond:
            self._reading = False
            if request is not None:
                self._ready.append(request)
            else:
                self._exhausted = True
                self._error = error
            self._cond.notify_all()
