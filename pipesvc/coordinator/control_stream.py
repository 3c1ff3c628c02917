"""The coordinator's Control streams: one per job and stage server, carrying runs, commits and
aborts, their replies matched to futures.

[Note: control stream] A step used to be one unary RunStep per stage, its commit carried inside
the next one (see [Note: deferred commit] in ledger.py), an explicit Commit per stage to flush it,
and an Abort per stage after a failure: a call, with its HTTP/2 stream, headers, trailers and a
server thread, per stage per message. Now the coordinator opens one bidirectional ``Control``
stream per (job, stage server, plan epoch) the first time it needs one, and keeps it open:

- Each ``ControlRequest`` carries an id and one of ``run`` (a RunStepRequest; its tensors'
  bytes beside the message as in [Note: payload wire], never copied into protobuf),
  ``commit`` or ``abort``; the deferred commit rides on the run as before. Each
  ``ControlReply`` carries the same id and the response, or a ``ControlError``: the status code,
  message and trailing metadata the unary call would have ended with, so the caller raises the
  same typed ``PipesvcError`` (``control_wire.reply_error``, built on ``rpc_status``).
- The stage handles each message with the code of its unary call (``StageService._run_step``,
  ``_commit``, ``_abort``) on a worker of its own, so an abort overtakes a run still computing
  on the same stream (``pipesvc.stage.control``). The unary RPCs stay, for tools and older
  coordinators.
- Here a future per message id: ``send`` returns it and the stream's reader thread resolves it.
  Waiting is the caller's: ``stage_calls.gather`` waits on these futures exactly as on unary
  ones, with the health watchdog (see [Note: detection]) and the deadline, so a dead stage is
  found as quickly as before; a stream that breaks (stage killed, connection cut) fails every
  outstanding future with the error its unary calls would have got (UNAVAILABLE:
  ``StageUnavailableError``), and the next message opens a new stream.
- A stage that answers UNIMPLEMENTED (built before Control) gets the unary calls, its
  outstanding messages sent again over them (it never saw them), until it registers anew.
- Streams close when the job's plan epoch changes (``StageGroup.epoch``), when the job releases
  a stage or the job itself (``StageRegistry.release``), when a stage is declared lost, and when
  the coordinator stops (``StageRegistry.close``): closing ends the request side (so gRPC's
  request thread returns), cancels the call and joins the reader thread.
- Token and TLS are the channel's, as for every call: ``TokenInterceptor`` adds the token to
  streams too, and the stage's ``AuthInterceptor`` refuses a stream without it, which fails
  its messages with ``UnauthenticatedError``.
- A message larger than the channel's limit is refused here (``ResourceExhaustedError``)
  without touching the stream; one the stage's smaller limit refuses ends that stream with
  RESOURCE_EXHAUSTED, and the next message opens another. The stage answers a message of no
  known kind with ``InvalidArgumentError`` and goes on serving the stream.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from pipesvc.errors import (
    InternalError,
    PipesvcError,
    ResourceExhaustedError,
    StageUnavailableError,
    StepAbortedError,
)
from pipesvc.v1 import stage_pb2
from pipesvc.wire.control_wire import Kind, identity, reply_error, request_bytes
from pipesvc.wire.rpc_status import error_from_rpc

logger = logging.getLogger(__name__)

CONTROL_PATH = "/pipesvc.v1.StageService/Control"
assert stage_pb2.DESCRIPTOR.services_by_name["StageService"].methods_by_name["Control"]

Unary = Callable[[str, Kind, Message, Sequence[memoryview], float], "grpc.Future[Any]"]
"""Sends one message as its unary call (RunStep, Commit or Abort) to a stage: the fallback."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """A message sent and not answered yet (kept whole for a fallback to unary calls)."""

    kind: Kind
    message: Message
    payloads: Sequence[memoryview]
    timeout_s: float
    future: futures.Future[Any]


def _settle(
    future: futures.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    """Resolves ``future`` unless it is done already (cancelled by a watchdog, say)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except futures.InvalidStateError:
        pass


class ControlStream:
    """One open Control stream to the stage at ``address`` for job ``job_id`` at plan
    ``epoch``; ``send`` queues a message and returns the future of its reply."""

    def __init__(
        self,
        *,
        channel: grpc.Channel,
        address: str,
        job_id: str,
        epoch: int,
        max_message_bytes: int,
        unimplemented: Callable[[ControlStream, list[_Pending]], None],
    ) -> None:
        self.address = address
        self.job_id = job_id
        self.epoch = epoch
        self._max_bytes = max_message_bytes
        self._unimplemented = unimplemented
        self._lock = threading.Lock()
        self._awaiting: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._ended = False
        """Broken or closed: no message is sent on it any more."""
        method = channel.stream_stream(
            CONTROL_PATH,
            request_serializer=identity,
            response_deserializer=stage_pb2.ControlReply.FromString,
        )
        self._call: Any = method(self._requests())
        self._reader = threading.Thread(
            target=self._read, name=f"control-stream-{address}", daemon=True
        )
        self._reader.start()

    @property
    def alive(self) -> bool:
        """Whether messages can still be sent on it."""
        return not self._ended

    def send(
        self, kind: Kind, message: Message, payloads: Sequence[memoryview], timeout_s: float
    ) -> futures.Future[Any] | None:
        """Queues ``message`` as ``kind``; the future of its reply's response (or its typed
        error), or None when the stream has ended (the caller opens another)."""
        future: futures.Future[Any] = futures.Future()
        with self._lock:
            if self._ended:
                return None
            message_id = next(self._ids)
        data = request_bytes(message_id, kind, message, payloads)
        if len(data) > self._max_bytes:
            future.set_exception(
                ResourceExhaustedError(
                    f"a control {kind} of {len(data)} bytes is over the message limit of "
                    f"{self._max_bytes} bytes"
                )
            )
            return future
        with self._lock:
            if self._ended:
                return None
            self._awaiting[message_id] = _Pending(kind, message, payloads, timeout_s, future)
            self._outgoing.put(data)
        return future

    def close(self) -> None:
        """Ends the stream: its outstanding futures fail as unavailable, its threads end."""
        with self._lock:
            self._ended = True
        self._outgoing.put(None)
        self._call.cancel()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5.0)

    def _requests(self) -> Iterator[bytes]:
        """What gRPC's request thread sends: queued messages until the stream ends."""
        while True:
            data = self._outgoing.get()
            if data is None:
                return
            yield data

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            for reply in self._call:
                self._resolve(reply)
        except BaseException as exc:
            error = exc
        self._end(error)

    def _resolve(self, reply: stage_pb2.ControlReply) -> None:
        with self._lock:
            pending = self._awaiting.pop(reply.id, None)
        if pending is None:
            return  # not ours, or already failed
        result = reply.WhichOneof("result")
        if result == "error":
            _settle(pending.future, error=reply_error(reply, ""))
        elif result == pending.kind:
            _settle(pending.future, getattr(reply, result))
        else:
            _settle(
                pending.future,
                error=InternalError(
                    f"the stage answered control {pending.kind} {reply.id} with {result!r}"
                ),
            )

    def _end(self, error: BaseException | None) -> None:
        """The stream is over: fails (or hands to unary calls) every outstanding message."""
        unimplemented = (
            isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNIMPLEMENTED
        )
        if unimplemented and not self._ended:
            # Before the stream counts as ended: a message sent from then on must find the
            # stage marked, not open another stream to it.
            self._unimplemented(self, [])
        with self._lock:
            closed = self._ended and not unimplemented
            self._ended = True
            pending, self._awaiting = list(self._awaiting.values()), {}
        self._outgoing.put(None)  # gRPC's request thread returns
        if unimplemented and not closed:
            self._unimplemented(self, pending)
            return
        if closed:
            failure: PipesvcError = StageUnavailableError("the control stream was closed")
        elif isinstance(error, grpc.RpcError):
            failure = error_from_rpc(error)
        elif error is not None:
            failure = StageUnavailableError(f"the control stream failed: {error}")
        else:
            failure = StageUnavailableError("the stage ended the control stream")
        if pending:
            logger.info(
                "control stream to %s (job %s) ended with %d messages outstanding: %s",
                self.address,
                self.job_id,
                len(pending),
                failure,
            )
        for item in pending:
            _settle(item.future, error=failure)


class ControlStreams:
    """Every open Control stream of a coordinator, by job and stage address, and the stages
    that have none (sent unary calls instead); see [Note: control stream]."""

    def __init__(
        self,
        *,
        channel: Callable[[str], grpc.Channel],
        unary: Unary,
        max_message_bytes: int,
    ) -> None:
        self._channel = channel
        self._unary = unary
        self._max_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._streams: dict[tuple[str, str], ControlStream] = {}
        self._unary_only: set[str] = set()
        self.opened = 0
        """Streams opened so far (for tests and the bench)."""

    def send(
        self,
        address: str,
        *,
        job_id: str,
        epoch: int,
        kind: Kind,
        message: Message,
        payloads: Sequence[memoryview] = (),
        timeout_s: float,
    ) -> futures.Future[Any]:
        """Sends ``message`` as ``kind`` to the stage at ``address`` on the job's stream at
        ``epoch`` (opened now if there is none, or it broke, or it is of another epoch), or as
        its unary call to a stage without Control; the future of the response (its error: the
        typed ``PipesvcError`` the unary call would raise, not named after the stage).
        ``timeout_s`` bounds a unary call; a stream's messages are waited for by the caller.
        """
        for _ in range(3):
            stale: ControlStream | None = None
            with self._lock:
                if address in self._unary_only:
                    stream = None
                else:
                    key = (job_id, address)
                    stream = self._streams.get(key)
                    if stream is None or not stream.alive or stream.epoch != epoch:
                        stale = stream
                        stream = ControlStream(
                            channel=self._channel(address),
                            address=address,
                            job_id=job_id,
                            epoch=epoch,
                            max_message_bytes=self._max_bytes,
                            unimplemented=self._fall_back,
                        )
                        self._streams[key] = stream
                        self.opened += 1
            if stale is not None:
                stale.close()
            if stream is None:
                return self._via_unary(address, kind, message, payloads, timeout_s)
            future = stream.send(kind, message, payloads, timeout_s)
            if future is not None:
                return future
        failed: futures.Future[Any] = futures.Future()
        failed.set_exception(StageUnavailableError("the control stream keeps ending"))
        return failed

    def close(self, job_id: str | None = None, address: str | None = None) -> None:
        """Closes the streams of ``job_id`` (None: every job's) to ``address`` (None: every
        stage's)."""
        with self._lock:
            keys = [
                k
                for k in self._streams
                if (job_id is None or k[0] == job_id) and (address is None or k[1] == address)
            ]
            closing = [self._streams.pop(k) for k in keys]
        for stream in closing:
            stream.close()

    def close_other_epochs(self, job_id: str, epoch: int) -> None:
        """Closes the job's streams of plan epochs other than ``epoch``."""
        with self._lock:
            keys = [k for k, s in self._streams.items() if k[0] == job_id and s.epoch != epoch]
            closing = [self._streams.pop(k) for k in keys]
        for stream in closing:
            stream.close()

    def forget(self, address: str) -> None:
        """The stage at ``address`` registered anew (perhaps upgraded): try Control again."""
        with self._lock:
            self._unary_only.discard(address)

    def open_count(self) -> int:
        """Streams open now."""
        with self._lock:
            return sum(1 for s in self._streams.values() if s.alive)

    def _fall_back(self, stream: ControlStream, pending: list[_Pending]) -> None:
        """``stream``'s stage has no Control: unary calls from now on, the outstanding
        messages first (the stage never handled them)."""
        with self._lock:
            new = stream.address not in self._unary_only
            self._unary_only.add(stream.address)
            if self._streams.get((stream.job_id, stream.address)) is stream:
                del self._streams[(stream.job_id, stream.address)]
        if new:
            logger.warning(
                "stage %s has no Control stream (an older stage?): sending it unary calls",
                stream.address,
            )
        for item in pending:
            self._via_unary(
                stream.address, item.kind, item.message, item.payloads, item.timeout_s, item.future
            )

    def _via_unary(
        self,
        address: str,
        kind: Kind,
        message: Message,
        payloads: Sequence[memoryview],
        timeout_s: float,
        future: futures.Future[Any] | None = None,
    ) -> futures.Future[Any]:
        result: futures.Future[Any] = future if future is not None else futures.Future()
        try:
            call = self._unary(address, kind, message, payloads, timeout_s)
        except Exception as exc:  # e.g. a serializer's refusal
            _settle(result, error=exc if isinstance(exc, PipesvcError) else InternalError(str(exc)))
            return result

        def done(finished: grpc.Future[Any]) -> None:
            if finished.cancelled():
                _settle(result, error=StepAbortedError("the call was cancelled"))
                return
            exc = finished.exception()
            if exc is None:
                _settle(result, finished.result())
            elif isinstance(exc, grpc.RpcError):
                _settle(result, error=error_from_rpc(exc))
            else:
                _settle(result, error=StageUnavailableError(str(exc)))

        call.add_done_callback(done)
        result.add_done_callback(lambda f: call.cancel() if f.cancelled() else None)
        return result
