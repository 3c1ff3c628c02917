"""The data plane between neighbouring stages: one long-lived bidirectional stream per pair.

The upstream stage opens ``Exchange`` on its downstream neighbour once per job and keeps it:
activation frames flow down the request side, gradient frames come back on the response side.
Encoding and sending run on gRPC's stream threads, fed by bounded queues, so a stage computes
the next micro-batch while the previous one is on the wire. Between stages on one host the
payloads go through shared memory instead (see [Note: the shared-memory path] in pipesvc.shm).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeAlias

import grpc
import torch

from pipesvc.errors import PipesvcError, StageUnavailableError, WireFormatError
from pipesvc.metrics import NO_METRICS, Metrics
from pipesvc.rpc_status import error_from_rpc
from pipesvc.shm import DEFAULT_AREA_BYTES, MAX_AREA_BYTES, ShmArea, ShmView
from pipesvc.stage.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
from pipesvc.tensor_codec import (
    DEFAULT_FRAME_BYTES,
    CodecLimits,
    FrameAssembler,
    check_header,
    empty_like_header,
    encode_frames,
    make_header,
)
from pipesvc.v1 import stage_pb2, stage_pb2_grpc

logger = logging.getLogger(__name__)

_DIRECTIONS = {stage_pb2.ACTIVATION: ACTIVATION, stage_pb2.GRADIENT: GRADIENT}
_WIRE_DIRECTIONS = {v: k for k, v in _DIRECTIONS.items()}
SEND_QUEUE_ITEMS = 64
"""Tensors waiting to be sent before a sender blocks (backpressure)."""

_Outgoing: TypeAlias = "tuple[MailKey, torch.Tensor] | stage_pb2.DataFrame | PipesvcError | None"


def _ident(
    job_id: str, epoch: int, direction: str, key: MailKey | None = None
) -> stage_pb2.MicrobatchId:
    return stage_pb2.MicrobatchId(
        job_id=job_id,
        plan_epoch=epoch,
        run_id=key.run_id if key else 0,
        microbatch_index=key.microbatch_index if key else 0,
        direction=_WIRE_DIRECTIONS[direction],
    )


class Sender:
    """One direction of a stream: turns queued tensors into frames, through shared memory
    once the receiver has accepted this sender's area.

    ``frames()`` is the generator gRPC sends from (on its own thread); ``put`` queues a tensor,
    a control frame, an error to end the stream with, or None to end it cleanly.
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
    ) -> None:
        self._job_id = job_id
        self._epoch = epoch
        self._direction = direction
        self._copies = copies
        self._shm_bytes = shm_bytes
        self._metrics = metrics
        self._queue: queue.Queue[_Outgoing] = queue.Queue(SEND_QUEUE_ITEMS)
        self._area: ShmArea | None = None
        self._offered = False
        self._accepted = False
        self._refused = False

    @property
    def uses_shm(self) -> bool:
        """Whether payloads now go through shared memory."""
        return self._accepted and not self._refused

    def put(self, item: _Outgoing) -> None:
        """Queues an item (blocks while the queue is full)."""
        self._queue.put(item)
        self._metrics.set("queue_depth", self._queue.qsize(), queue="send")

    def on_answer(self, answer: stage_pb2.ShmAnswer) -> None:
        """The receiver's answer to this sender's offer (called from the reading thread)."""
        area = self._area
        if area is None or answer.name != area.name:
            return
        if answer.accepted:
            self._accepted = True
        else:
            self._refused = True
            logger.info("shared memory refused by the peer (%s); sending frames", answer.reason)
        area.unlink()

    def frames(self) -> Iterator[stage_pb2.DataFrame]:
        """The stream's frames until None or an error is queued.

        Raises:
            PipesvcError: the queued error, to end the stream with its status.
        """
        try:
            while (item := self._queue.get()) is not None:
                if isinstance(item, PipesvcError):
                    raise item
                if isinstance(item, stage_pb2.DataFrame):
                    yield item
                    continue
                if not self._offered:
                    self._offered = True
                    offer = self._offer()
                    if offer is not None:
                        yield offer
                for _ in range(self._copies):
                    yield from self._tensor_frames(*item)
        finally:
            if self._area is not None:
                self._area.close()

    def _offer(self) -> stage_pb2.DataFrame | None:
        if self._shm_bytes <= 0:
            return None
        self._area = ShmArea.create(self._shm_bytes)
        if self._area is None:
            return None
        return stage_pb2.DataFrame(
            id=_ident(self._job_id, self._epoch, self._direction),
            shm_offer=stage_pb2.ShmOffer(
                name=self._area.name, nonce=self._area.nonce, size=self._area.size
            ),
        )

    def _tensor_frames(self, key: MailKey, tensor: torch.Tensor) -> Iterator[stage_pb2.DataFrame]:
        ident = _ident(self._job_id, self._epoch, self._direction, key)
        num_bytes = tensor.numel() * tensor.element_size()
        self._metrics.inc("bytes_total", num_bytes, direction="sent", kind=key.direction)
        if self._refused and self._area is not None:
            self._area.close()
            self._area = None
        if self._accepted and self._area is not None:
            slot = self._area.write(tensor)
            if slot is not None:
                self._metrics.inc("frames_total", direction="sent", kind=key.direction)
                yield stage_pb2.DataFrame(
                    id=ident,
                    header=make_header(tensor),
                    shm_slot=stage_pb2.ShmSlot(seq=slot.seq, offset=slot.offset),
                )
                return
        header, payloads = encode_frames(tensor, DEFAULT_FRAME_BYTES)
        for index, data in enumerate(payloads):
            frame = stage_pb2.DataFrame(id=ident, frame_index=index, data=data)
            if index == 0:
                frame.header.CopyFrom(header)
            self._metrics.inc("frames_total", direction="sent", kind=key.direction)
            yield frame


class FrameReader:
    """Turns incoming frames into whole tensors in a mailbox, checking identity and order.

    It also takes the shared-memory handshake: it answers an offer through ``reply`` (the sender
    of the opposite direction on the same stream) and hands the peer's answer to ``reply``.
    """

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        direction: str,
        mailbox: Mailbox,
        limits: CodecLimits,
        metrics: Metrics,
        reply: Sender,
    ) -> None:
        self._metrics = metrics
        self._job_id = job_id
        self._epoch = epoch
        self._direction = direction
        self._mailbox = mailbox
        self._limits = limits
        self._reply = reply
        self._pending: tuple[MailKey, FrameAssembler] | None = None
        self._view: ShmView | None = None

    def close(self) -> None:
        """Unmaps the peer's area, if any."""
        if self._view is not None:
            self._view.close()
            self._view = None

    def feed(self, frame: stage_pb2.DataFrame) -> bool:
        """Adds one frame; a completed tensor goes to the mailbox. Returns True when a tensor
        was completed and accepted (not stale, not a duplicate).

        Raises:
            WireFormatError: wrong job, epoch or direction, frames out of order, or a bad
                shared-memory offer or slot.
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
        if frame.HasField("shm_offer"):
            self._take_offer(frame.shm_offer)
            return False
        if frame.HasField("shm_answer"):
            self._reply.on_answer(frame.shm_answer)
            return False
        key = MailKey(ident.run_id, self._direction, ident.microbatch_index)
        self._metrics.inc("frames_total", direction="received", kind=self._direction)
        if frame.HasField("shm_slot"):
            tensor: torch.Tensor | None = self._read_slot(key, frame)
        else:
            tensor = self._add_frame(key, frame)
        if tensor is None:
            return False
        self._metrics.inc(
            "bytes_total",
            tensor.numel() * tensor.element_size(),
            direction="received",
            kind=self._direction,
        )
        accepted = self._mailbox.put(key, tensor)
        self._metrics.set("queue_depth", len(self._mailbox), queue="mailbox")
        return accepted

    def _add_frame(self, key: MailKey, frame: stage_pb2.DataFrame) -> torch.Tensor | None:
        if frame.frame_index == 0:
            if self._pending is not None:
                raise WireFormatError(f"{key} started before {self._pending[0]} was complete")
            self._pending = (key, FrameAssembler(frame.header, self._limits))
        if self._pending is None or self._pending[0] != key:
            raise WireFormatError(f"frame {frame.frame_index} of {key} without its frame 0")
        tensor = self._pending[1].add(frame.frame_index, frame.data)
        if tensor is not None:
            self._pending = None
        return tensor

    def _read_slot(self, key: MailKey, frame: stage_pb2.DataFrame) -> torch.Tensor:
        if self._view is None:
            raise WireFormatError(f"{key} arrived in shared memory before an accepted offer")
        if self._pending is not None:
            raise WireFormatError(f"{key} started before {self._pending[0]} was complete")
        if frame.frame_index != 0 or frame.data or frame.header.num_frames != 1:
            raise WireFormatError(
                f"{key} in shared memory must be one frame (index 0, num_frames 1, no data)"
            )
        check_header(frame.header, self._limits)
        out = empty_like_header(frame.header)
        return self._view.read(frame.shm_slot.seq, frame.shm_slot.offset, out)

    def _take_offer(self, offer: stage_pb2.ShmOffer) -> None:
        self.close()
        answer = stage_pb2.ShmAnswer(name=offer.name)
        try:
            self._view = ShmView(offer.name, offer.nonce, offer.size, MAX_AREA_BYTES)
            answer.accepted = True
        except OSError as exc:
            answer.reason = f"cannot map {offer.name}: {exc.strerror or exc}"
        ident = _ident(
            self._job_id, self._epoch, GRADIENT if self._direction == ACTIVATION else ACTIVATION
        )
        self._reply.put(stage_pb2.DataFrame(id=ident, shm_answer=answer))


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
        shm_bytes: int = DEFAULT_AREA_BYTES,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.address = address
        self._mailbox = mailbox
        self._sender = Sender(
            job_id=job_id,
            epoch=epoch,
            direction=ACTIVATION,
            copies=2 if duplicate_sends else 1,
            shm_bytes=shm_bytes,
            metrics=metrics,
        )
        self._reader = FrameReader(
            job_id=job_id,
            epoch=epoch,
            direction=GRADIENT,
            mailbox=mailbox,
            limits=limits,
            metrics=metrics,
            reply=self._sender,
        )
        stub = stage_pb2_grpc.StageServiceStub(channel)
        self._call = stub.Exchange(self._sender.frames(), wait_for_ready=True)
        self._thread = threading.Thread(target=self._read, name=f"from-{address}", daemon=True)
        self._thread.start()

    @property
    def uses_shm(self) -> bool:
        """Whether activations now go through shared memory."""
        return self._sender.uses_shm

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        """Queues an activation for sending (blocks while the queue is full)."""
        self._sender.put((key, tensor.detach()))

    def close(self) -> None:
        """Ends the stream; the reader thread exits once the peer closes its side."""
        self._sender.put(None)
        self._call.cancel()
        self._thread.join(timeout=5)

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
        finally:
            self._reader.close()


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
        shm_bytes: int = DEFAULT_AREA_BYTES,
        metrics: Metrics = NO_METRICS,
        on_established: Callable[[UpstreamLink], None] | None = None,
    ) -> None:
        self._on_established = on_established
        self.job_id = job_id
        self.epoch = epoch
        self._sender = Sender(
            job_id=job_id,
            epoch=epoch,
            direction=GRADIENT,
            copies=2 if duplicate_sends else 1,
            shm_bytes=shm_bytes,
            metrics=metrics,
        )
        self._reader = FrameReader(
            job_id=job_id,
            epoch=epoch,
            direction=ACTIVATION,
            mailbox=mailbox,
            limits=limits,
            metrics=metrics,
            reply=self._sender,
        )

    @property
    def uses_shm(self) -> bool:
        """Whether gradients now go through shared memory."""
        return self._sender.uses_shm

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        """Queues a gradient for the upstream stage."""
        self._sender.put((key, tensor.detach()))

    def close(self) -> None:
        """Ends the response side of the stream."""
        self._sender.put(None)

    def serve(self, requests: Iterable[stage_pb2.DataFrame]) -> Iterator[stage_pb2.DataFrame]:
        """Runs the stream: a thread reads activations, this generator yields gradients.

        Raises:
            PipesvcError: a malformed frame arrived; the stream ends with its status.
        """
        thread = threading.Thread(target=self._read, args=(requests,), daemon=True)
        thread.start()
        yield from self._sender.frames()

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
            self._sender.put(exc)
            return
        except grpc.RpcError:
            pass  # the upstream went away; its own side reports the failure
        finally:
            self._reader.close()
        self._sender.put(None)
