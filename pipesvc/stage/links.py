"""The data plane between neighbouring stages: one long-lived bidirectional stream per pair.

The upstream stage opens ``Exchange`` on its downstream neighbour once per job and keeps it:
activation frames flow down the request side, gradient frames come back on the response side.
Encoding and sending run on gRPC's stream threads, fed by bounded queues, so a stage computes
the next micro-batch while the previous one is on the wire.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import grpc
import torch

from pipesvc.errors import PipesvcError, StageUnavailableError, WireFormatError
from pipesvc.metrics import NO_METRICS, Metrics
from pipesvc.rpc_status import error_from_rpc
from pipesvc.stage.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
from pipesvc.tensor_codec import DEFAULT_FRAME_BYTES, CodecLimits, FrameAssembler, encode_frames
from pipesvc.v1 import stage_pb2, stage_pb2_grpc

logger = logging.getLogger(__name__)

_DIRECTIONS = {stage_pb2.ACTIVATION: ACTIVATION, stage_pb2.GRADIENT: GRADIENT}
_WIRE_DIRECTIONS = {v: k for k, v in _DIRECTIONS.items()}
SEND_QUEUE_ITEMS = 64
"""Tensors waiting to be sent before a sender blocks (backpressure)."""

_Outgoing = tuple[MailKey, torch.Tensor] | None


def _frames(
    item: tuple[MailKey, torch.Tensor], job_id: str, epoch: int, copies: int, metrics: Metrics
) -> Iterator[stage_pb2.DataFrame]:
    """The frames of one tensor; ``copies`` > 1 repeats them (fault injection for tests)."""
    key, tensor = item
    header, payloads = encode_frames(tensor, DEFAULT_FRAME_BYTES)
    ident = stage_pb2.MicrobatchId(
        job_id=job_id,
        plan_epoch=epoch,
        run_id=key.run_id,
        microbatch_index=key.microbatch_index,
        direction=_WIRE_DIRECTIONS[key.direction],
    )
    frames = []
    for index, data in enumerate(payloads):
        frame = stage_pb2.DataFrame(id=ident, frame_index=index, data=data)
        if index == 0:
            frame.header.CopyFrom(header)
        frames.append(frame)
    metrics.inc("frames_total", len(frames) * copies, direction="sent", kind=key.direction)
    metrics.inc("bytes_total", header.num_bytes * copies, direction="sent", kind=key.direction)
    for _ in range(copies):
        yield from frames


class FrameReader:
    """Turns incoming frames into whole tensors in a mailbox, checking identity and order."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        direction: str,
        mailbox: Mailbox,
        limits: CodecLimits,
        metrics: Metrics,
    ) -> None:
        self._metrics = metrics
        self._job_id = job_id
        self._epoch = epoch
        self._direction = direction
        self._mailbox = mailbox
        self._limits = limits
        self._pending: tuple[MailKey, FrameAssembler] | None = None

    def feed(self, frame: stage_pb2.DataFrame) -> bool:
        """Adds one frame; a completed tensor goes to the mailbox. Returns True when a tensor
        was completed and accepted (not stale, not a duplicate).

        Raises:
            WireFormatError: wrong job, epoch or direction, or frames out of order.
        """
        ident = frame.id
        if ident.job_id != self._job_id or ident.plan_epoch != self._epoch:
            raise WireFormatError(
                f"frame for job {ident.job_id!r} epoch {ident.plan_epoch}; this stream carries "
                f"job {self._job_id!r} epoch {self._epoch}"
            )
        if _DIRECTIONS.get(ident.direction) != self._direction:
            raise WireFormatError(
                f"frame direction {ident.direction} on a stream carrying {self._direction}"
            )
        key = MailKey(ident.run_id, self._direction, ident.microbatch_index)
        if frame.frame_index == 0:
            if self._pending is not None:
                raise WireFormatError(f"{key} started before {self._pending[0]} was complete")
            self._pending = (key, FrameAssembler(frame.header, self._limits))
        if self._pending is None or self._pending[0] != key:
            raise WireFormatError(f"frame {frame.frame_index} of {key} without its frame 0")
        tensor = self._pending[1].add(frame.frame_index, frame.data)
        self._metrics.inc("frames_total", direction="received", kind=self._direction)
        self._metrics.inc(
            "bytes_total", len(frame.data), direction="received", kind=self._direction
        )
        if tensor is None:
            return False
        self._pending = None
        accepted = self._mailbox.put(key, tensor)
        self._metrics.set("queue_depth", len(self._mailbox), queue="mailbox")
        return accepted


class DownstreamLink:
    """This stage's stream to rank + 1: sends activations, receives gradients."""

    def __init__(
        self,
        *,
        channel: grpc.Channel,
        address: str,
        job_id: str,
        epoch: int,
        mailbox: Mailbox,
        limits: CodecLimits,
        duplicate_sends: bool = False,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.address = address
        self._metrics = metrics
        self._copies = 2 if duplicate_sends else 1
        self._job_id = job_id
        self._epoch = epoch
        self._queue: queue.Queue[_Outgoing] = queue.Queue(SEND_QUEUE_ITEMS)
        self._mailbox = mailbox
        self._reader = FrameReader(
            job_id=job_id,
            epoch=epoch,
            direction=GRADIENT,
            mailbox=mailbox,
            limits=limits,
            metrics=metrics,
        )
        stub = stage_pb2_grpc.StageServiceStub(channel)
        self._call = stub.Exchange(self._requests(), wait_for_ready=True)
        self._thread = threading.Thread(target=self._read, name=f"from-{address}", daemon=True)
        self._thread.start()

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        """Queues an activation for sending (blocks while the queue is full)."""
        self._queue.put((key, tensor.detach()))
        self._metrics.set("queue_depth", self._queue.qsize(), queue="send")

    def close(self) -> None:
        """Ends the stream; the reader thread exits once the peer closes its side."""
        self._queue.put(None)
        self._call.cancel()
        self._thread.join(timeout=5)

    def _requests(self) -> Iterator[stage_pb2.DataFrame]:
        while (item := self._queue.get()) is not None:
            yield from _frames(item, self._job_id, self._epoch, self._copies, self._metrics)

    def _read(self) -> None:
        try:
            for frame in self._call:
                self._reader.feed(frame)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                error = error_from_rpc(exc, f"stream to downstream stage {self.address}")
                logger.warning("data stream to %s failed: %s", self.address, error)
                self._mailbox.fail(
                    StageUnavailableError(f"data stream to {self.address} failed: {error}")
                )
        except PipesvcError as exc:
            logger.warning("bad frame from downstream %s: %s", self.address, exc)
            self._mailbox.fail(exc)
            self._call.cancel()


class UpstreamLink:
    """The server side of Exchange from rank - 1: receives activations, sends gradients."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        mailbox: Mailbox,
        limits: CodecLimits,
        duplicate_sends: bool = False,
        metrics: Metrics = NO_METRICS,
        on_established: Callable[[UpstreamLink], None] | None = None,
    ) -> None:
        self._metrics = metrics
        self._on_established = on_established
        self.job_id = job_id
        self._copies = 2 if duplicate_sends else 1
        self.epoch = epoch
        self._queue: queue.Queue[_Outgoing | PipesvcError] = queue.Queue(SEND_QUEUE_ITEMS)
        self._reader = FrameReader(
            job_id=job_id,
            epoch=epoch,
            direction=ACTIVATION,
            mailbox=mailbox,
            limits=limits,
            metrics=metrics,
        )

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        """Queues a gradient for the upstream stage."""
        self._queue.put((key, tensor.detach()))
        self._metrics.set("queue_depth", self._queue.qsize(), queue="send")

    def close(self) -> None:
        """Ends the response side of the stream."""
        self._queue.put(None)

    def serve(self, requests: Iterable[stage_pb2.DataFrame]) -> Iterator[stage_pb2.DataFrame]:
        """Runs the stream: a thread reads activations, this generator yields gradients.

        Raises:
            PipesvcError: a malformed frame arrived; the stream ends with its status.
        """
        thread = threading.Thread(target=self._read, args=(requests,), daemon=True)
        thread.start()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, PipesvcError):
                raise item
            yield from _frames(item, self.job_id, self.epoch, self._copies, self._metrics)

    def _read(self, requests: Iterable[stage_pb2.DataFrame]) -> None:
        established = False
        try:
            for frame in requests:
                # Only a stream that delivers a tensor the mailbox accepts (a current run's,
                # not stale, not a duplicate) becomes the link gradients go back on.
                if self._reader.feed(frame) and not established:
                    if self._on_established is not None:
                        self._on_established(self)
                    established = True
        except PipesvcError as exc:
            logger.warning("bad frame from upstream: %s", exc)
            self._queue.put(exc)
            return
        except grpc.RpcError:
            pass  # the upstream went away; its own side reports the failure
        self._queue.put(None)
