"""The stage's end of a Control stream: each message handled on a worker, replies as they finish.

See [Note: control stream] in ``pipesvc.coordinator.control_stream``. The handler of each kind
is the same code as the unary RunStep, Commit and Abort (``StageService``); this module only
moves messages between the stream and the workers, so an abort is read and handled while a
run of the same stream still computes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures

import grpc

from pipesvc.errors import PipesvcError, ResourceExhaustedError, StageUnavailableError
from pipesvc.v1 import stage_pb2
from pipesvc.wire.control_wire import Reply, Unreadable, failed
from pipesvc.wire.payload_wire import Incoming
from pipesvc.wire.rpc_status import to_pipesvc

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 8
"""Messages of one stream handled at once; one more gets RESOURCE_EXHAUSTED (the coordinator
has at most a run, its abort and a commit out: this bounds what a misbehaving peer can start)."""

Handle = Callable[[Incoming[stage_pb2.ControlRequest]], Reply]
"""Handles one parsed message; returns its reply (an error reply rather than raising)."""


class _End:
    """The end of a stream's replies."""


_END = _End()


class ControlServer:
    """Serves one Control stream: reads messages on a thread of its own, hands each to the
    ``pool`` (so messages are handled concurrently: an abort overtakes a run), and yields the
    replies in the order they finish."""

    def __init__(self, handle: Handle, pool: futures.Executor) -> None:
        self._handle = handle
        self._pool = pool
        self._replies: queue.SimpleQueue[Reply | _End | PipesvcError] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._reading = True

    def serve(
        self,
        requests: Iterable[Incoming[stage_pb2.ControlRequest] | Unreadable],
        context: grpc.ServicerContext,
    ) -> Iterator[Reply]:
        """The stream's replies; ends once the coordinator closed its side and every message
        was answered, or when the call ends (cancelled, or the coordinator went away).

        Raises:
            WireFormatError: a message did not parse and its id could not be read (the stream
                is no longer trustworthy; the stage stays up).
        """
        context.add_callback(lambda: self._replies.put(_END))
        reader = threading.Thread(
            target=self._read, args=(requests,), name="control-reader", daemon=True
        )
        reader.start()
        while True:
            item = self._replies.get()
            if isinstance(item, _End):
                return
            if isinstance(item, PipesvcError):
                raise item
            yield item

    def _read(self, requests: Iterable[Incoming[stage_pb2.ControlRequest] | Unreadable]) -> None:
        try:
            for received in requests:
                if isinstance(received, Unreadable):
                    if not received.message_id:
                        self._replies.put(received.error)
                        return
                    self._replies.put(failed(received.message_id, received.error))
                    continue
                message_id = received.message.id
                with self._lock:
                    full = self._in_flight >= MAX_IN_FLIGHT
                    if not full:
                        self._in_flight += 1
                if full:
                    self._replies.put(
                        failed(
                            message_id,
                            ResourceExhaustedError(
                                f"control message {message_id} refused: {MAX_IN_FLIGHT} "
                                "messages of this stream are already in flight (the limit)"
                            ),
                        )
                    )
                    continue
                try:
                    self._pool.submit(self._run, received)
                except RuntimeError:  # the stage is stopping: its pool takes no more work
                    self._done(failed(message_id, StageUnavailableError("the stage is stopping")))
        except Exception as exc:  # the call ended under the reader (cancelled, or gone)
            logger.debug("a control stream ended while reading: %s", exc)
        finally:
            with self._lock:
                self._reading = False
                idle = self._in_flight == 0
            if idle:
                self._replies.put(_END)

    def _run(self, received: Incoming[stage_pb2.ControlRequest]) -> None:
        try:
            reply = self._handle(received)
        except Exception as exc:  # a handler returns its errors; this is a bug's
            reply = failed(received.message.id, to_pipesvc(exc, "Control"))
        self._done(reply)

    def _done(self, reply: Reply) -> None:
        self._replies.put(reply)
        with self._lock:
            self._in_flight -= 1
            finished = not self._reading and self._in_flight == 0
        if finished:
            self._replies.put(_END)
