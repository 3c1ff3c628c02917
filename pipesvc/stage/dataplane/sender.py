"""One direction of an Exchange stream: the tensors (and control frames) a stage sends.

Sends wait only in short polls and fail once the stream ended or the run was aborted (see
[Note: bounded waits] in pipesvc.stage.net.links). No gRPC here: gRPC pulls ``frames()``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeAlias

import torch

from pipesvc.core.tensor_codec import STREAM_FRAME_BYTES, frame_views
from pipesvc.errors import PipesvcError, StageUnavailableError, StepAbortedError
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.stage.dataplane.frame_wire import OutFrame
from pipesvc.stage.dataplane.mailbox import MailKey
from pipesvc.stage.dataplane.microbatch_id import microbatch_id
from pipesvc.stage.dataplane.shm import DEFAULT_AREA_BYTES
from pipesvc.stage.dataplane.shm_handshake import ShmOutlet
from pipesvc.v1 import stage_pb2

SEND_QUEUE_ITEMS = 64
"""Tensors waiting to be sent before a sender waits (backpressure)."""
_POLL_S = 0.1
"""How often a waiting send checks whether its stream ended or its run was aborted."""

_Outgoing: TypeAlias = "tuple[MailKey, torch.Tensor] | stage_pb2.DataFrame | PipesvcError | None"


class Sender:
    """One direction of a stream.

    Until the receiver accepts this sender's shared-memory area, tensors are queued and sent as
    frames by ``frames()``, the generator gRPC sends from (on its own thread). Once accepted,
    ``put`` writes a tensor into the area and rings the doorbell from the calling thread (see
    [Note: the shared-memory path]); only when the area has no room does it still queue frames.
    ``put`` also takes a control frame, an error to end the stream with, or None to end it.
    One thread puts tensors; any thread may put the rest, or ``close`` (see [Note: bounded
    waits]).
    """

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        direction: str,
        copies: int = 1,
        shm_bytes: int = DEFAULT_AREA_BYTES,
        metrics: Metrics = NO_METRICS,
        peer: str = "the peer",
        run_aborted: Callable[[int], bool] = lambda run_id: False,
        frame_bytes: int = STREAM_FRAME_BYTES,
        while_full: Callable[[], None] = lambda: None,
    ) -> None:
        self._job_id = job_id
        self._frame_bytes = frame_bytes
        self._peer = peer
        self._run_aborted = run_aborted
        self._ended = threading.Event()
        self._epoch = epoch
        self._direction = direction
        self._copies = copies
        self._metrics = metrics
        self._queue: queue.Queue[_Outgoing] = queue.Queue(SEND_QUEUE_ITEMS)
        self._shm = ShmOutlet(
            job_id=job_id,
            epoch=epoch,
            direction=direction,
            copies=copies,
            shm_bytes=shm_bytes,
            metrics=metrics,
            run_aborted=run_aborted,
            while_full=while_full,
        )
        self._offered = False

    @property
    def uses_shm(self) -> bool:
        """Whether tensors now go through shared memory."""
        return self._shm.bell_open

    def put(self, item: _Outgoing) -> None:
        """Sends a tensor through shared memory, or queues an item for the stream (waits
        while the queue is full). After the stream ended, a control item is dropped.

        Raises:
            StageUnavailableError: a tensor after the stream ended (the peer is gone).
            StepAbortedError: the tensor's run was aborted while it waited.
        """
        key = item[0] if isinstance(item, tuple) else None
        if isinstance(item, tuple) and self._shm.bell_open and self._shm.send(*item):
            return
        queued = False
        while not queued:
            if key is not None and self._run_aborted(key.run_id):
                raise StepAbortedError(f"run {key.run_id} was aborted while sending {key}")
            if not self._ended.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    queued = True
                except queue.Full:
                    continue
            # Checked after queueing too: close() may have drained the queue meanwhile.
            if self._ended.is_set():
                if key is None:
                    return  # nothing left to answer or end
                raise StageUnavailableError(
                    f"the data stream to {self._peer} has ended; {key} was not sent"
                )
        self._metrics.set("queue_depth", self._queue.qsize(), queue="send")

    def close(self) -> None:
        """Ends the stream now, dropping what is queued; never waits. Later tensors raise."""
        self._ended.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        # Wakes frames() at once; if a put raced in, frames() sees the end within a poll.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._shm.close()  # wakes a ring() waiting on a full doorbell

    def on_answer(self, answer: stage_pb2.ShmAnswer) -> None:
        """The receiver's answer to this sender's offer (called from the reading thread)."""
        self._shm.on_answer(answer)

    def frames(self) -> Iterator[OutFrame | stage_pb2.DataFrame]:
        """The stream's frames until None or an error is queued (see [Note: frame wire]).

        Raises:
            PipesvcError: the queued error, to end the stream with its status.
        """
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._ended.is_set():
                        return
                    continue
                if item is None or self._ended.is_set():
                    return
                if isinstance(item, PipesvcError):
                    raise item
                if isinstance(item, stage_pb2.DataFrame):
                    yield item
                    continue
                if not self._offered:
                    self._offered = True
                    offer = self._shm.offer(self._ended.is_set)
                    if offer is not None:
                        yield offer
                for _ in range(self._copies):
                    yield from self._tensor_frames(*item)
        finally:
            # Nobody drains the queue any more: later sends fail instead of waiting.
            self._ended.set()
            self._shm.bell_open = False
            self._shm.close()

    def _tensor_frames(self, key: MailKey, tensor: torch.Tensor) -> Iterator[OutFrame]:
        ident = microbatch_id(self._job_id, self._epoch, self._direction, key)
        header, payloads = frame_views(tensor, self._frame_bytes)
        self._metrics.inc("bytes_total", header.num_bytes, direction="sent", kind=key.direction)
        for index, data in enumerate(payloads):
            if index == 0:
                frame = stage_pb2.DataFrame(id=ident, frame_index=0, header=header)
            else:
                frame = stage_pb2.DataFrame(id=ident, frame_index=index)
            self._metrics.inc("frames_total", direction="sent", kind=key.direction)
            yield OutFrame(frame, data)
