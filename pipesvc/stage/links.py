"""The data plane between neighbouring stages: one long-lived bidirectional stream per pair.

The upstream stage opens ``Exchange`` on its downstream neighbour once per job and keeps it:
activation frames flow down the request side, gradient frames come back on the response side.
Encoding and sending run on gRPC's stream threads, fed by bounded queues, so a stage computes
the next micro-batch while the previous one is on the wire. Between stages on one host the
payloads go through shared memory instead (see [Note: the shared-memory path] in pipesvc.shm).

[Note: bounded waits] No wait in the data plane outlives the stream or the run it serves. A
send waits for room in its queue (or the doorbell's pipe) in short polls, and fails at once
with StageUnavailableError once the stream has ended (gRPC stops draining a finished call, so
an unbounded ``put`` would hang the step and, with it, the run lock that Abort needs), and with
StepAbortedError once its run is aborted (Abort wakes a step blocked sending to a hung peer).
Closing a link never blocks: it marks the sender ended and drops what was queued.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeAlias

import grpc
import torch
from google.protobuf.message import DecodeError

from pipesvc.errors import (
    PipesvcError,
    StageUnavailableError,
    StepAbortedError,
    WireFormatError,
)
from pipesvc.metrics import NO_METRICS, Metrics
from pipesvc.rpc_status import error_from_rpc
from pipesvc.shm import DEFAULT_AREA_BYTES, MAX_AREA_BYTES, ShmArea, ShmView
from pipesvc.stage.frame_wire import InFrame, OutFrame, parse, serialize
from pipesvc.stage.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
from pipesvc.tensor_codec import (
    DEFAULT_FRAME_BYTES,
    CodecLimits,
    FrameAssembler,
    check_header,
    frame_views,
    make_header,
    view_as_header,
)
from pipesvc.v1 import stage_pb2, stage_pb2_grpc

logger = logging.getLogger(__name__)

_DIRECTIONS = {stage_pb2.ACTIVATION: ACTIVATION, stage_pb2.GRADIENT: GRADIENT}
_WIRE_DIRECTIONS = {v: k for k, v in _DIRECTIONS.items()}
EXCHANGE_METHOD = "/pipesvc.v1.StageService/Exchange"
SEND_QUEUE_ITEMS = 64
"""Tensors waiting to be sent before a sender waits (backpressure)."""
_POLL_S = 0.1
"""How often a waiting send checks whether its stream ended or its run was aborted."""

_Outgoing: TypeAlias = "tuple[MailKey, torch.Tensor] | stage_pb2.DataFrame | PipesvcError | None"


def _opposite(direction: str) -> str:
    return GRADIENT if direction == ACTIVATION else ACTIVATION


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
    ) -> None:
        self._job_id = job_id
        self._peer = peer
        self._run_aborted = run_aborted
        self._ended = threading.Event()
        self._epoch = epoch
        self._direction = direction
        self._copies = copies
        self._shm_bytes = shm_bytes
        self._metrics = metrics
        self._queue: queue.Queue[_Outgoing] = queue.Queue(SEND_QUEUE_ITEMS)
        self._area: ShmArea | None = None
        self._offered = False
        self._bell_open = False

    @property
    def uses_shm(self) -> bool:
        """Whether tensors now go through shared memory."""
        return self._bell_open

    def put(self, item: _Outgoing) -> None:
        """Sends a tensor through shared memory, or queues an item for the stream (waits
        while the queue is full). After the stream ended, a control item is dropped.

        Raises:
            StageUnavailableError: a tensor after the stream ended (the peer is gone).
            StepAbortedError: the tensor's run was aborted while it waited.
        """
        key = item[0] if isinstance(item, tuple) else None
        if isinstance(item, tuple) and self._bell_open and self._send_shared(*item):
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
        area = self._area
        if area is not None:
            area.close()  # wakes a ring() waiting on a full doorbell

    def on_answer(self, answer: stage_pb2.ShmAnswer) -> None:
        """The receiver's answer to this sender's offer (called from the reading thread)."""
        area = self._area
        if area is None or answer.name != area.name:
            return
        if answer.accepted and area.open_bell():
            self._bell_open = True
        else:
            logger.info(
                "shared memory refused by the peer (%s); sending frames",
                answer.reason or "doorbell not open",
            )
        area.unlink()

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
                    offer = self._offer()
                    if offer is not None:
                        yield offer
                for _ in range(self._copies):
                    yield from self._tensor_frames(*item)
        finally:
            # Nobody drains the queue any more: later sends fail instead of waiting.
            self._ended.set()
            self._bell_open = False
            if self._area is not None:
                self._area.close()

    def _offer(self) -> stage_pb2.DataFrame | None:
        if self._shm_bytes <= 0:
            return None
        self._area = ShmArea.create(self._shm_bytes)
        if self._area is None:
            return None
        if self._ended.is_set():  # closed while the area was made: close() missed it
            self._area.close()
            return None
        return stage_pb2.DataFrame(
            id=_ident(self._job_id, self._epoch, self._direction),
            shm_offer=stage_pb2.ShmOffer(
                name=self._area.name, nonce=self._area.nonce, size=self._area.size
            ),
        )

    def _send_shared(self, key: MailKey, tensor: torch.Tensor) -> bool:
        """Writes ``tensor`` into one slot of the area and rings the doorbell; False when the
        area has no room now (or the receiver is gone), so the caller queues frames instead.
        It never waits for room: the receiver may hold slots until its backward."""
        area = self._area
        if area is None:
            return False
        header = make_header(tensor)
        ident = _ident(self._job_id, self._epoch, self._direction, key)
        for copy in range(self._copies):
            slot = area.write(tensor)  # None also for an empty tensor: frames carry those
            if slot is None:
                return copy > 0
            frame = stage_pb2.DataFrame(
                id=ident,
                header=header,
                shm_slot=stage_pb2.ShmSlot(
                    seq=slot.seq, offset=slot.offset, length=header.num_bytes
                ),
            )
            try:
                rung = area.ring(frame.SerializeToString(), lambda: self._run_aborted(key.run_id))
            except OSError as exc:
                # The receiver closed its end: it is gone; the stream reports why.
                logger.info("doorbell to the peer failed (%s); sending frames", exc)
                self._bell_open = False
                return copy > 0
            if not rung:  # nothing was written: the slot goes back, the link stays usable
                area.retract()
                raise StepAbortedError(f"run {key.run_id} was aborted while sending {key}")
            self._metrics.inc("frames_total", direction="sent", kind=key.direction)
            self._metrics.inc("bytes_total", header.num_bytes, direction="sent", kind=key.direction)
        return True

    def _tensor_frames(self, key: MailKey, tensor: torch.Tensor) -> Iterator[OutFrame]:
        ident = _ident(self._job_id, self._epoch, self._direction, key)
        header, payloads = frame_views(tensor, DEFAULT_FRAME_BYTES)
        self._metrics.inc("bytes_total", header.num_bytes, direction="sent", kind=key.direction)
        for index, data in enumerate(payloads):
            frame = stage_pb2.DataFrame(id=ident, frame_index=index)
            if index == 0:
                frame.header.CopyFrom(header)
            self._metrics.inc("frames_total", direction="sent", kind=key.direction)
            yield OutFrame(frame, data)


class FrameReader:
    """Turns incoming frames into whole tensors in a mailbox, checking identity and order.

    It also takes the shared-memory handshake: it answers an offer through ``reply`` (the sender
    of the opposite direction on the same stream), hands the peer's answer to ``reply``, and
    once it has mapped the peer's area runs a thread reading the doorbell: each tensor goes to
    the mailbox, whether it was accepted to ``on_delivered``, and an error to ``fail``.
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
        on_delivered: Callable[[bool], None] | None = None,
        fail: Callable[[PipesvcError], None] | None = None,
        accept_shm: bool = True,
    ) -> None:
        self._metrics = metrics
        self._accept_shm = accept_shm
        self._job_id = job_id
        self._epoch = epoch
        self._direction = direction
        self._mailbox = mailbox
        self._limits = limits
        self._reply = reply
        self._on_delivered = on_delivered
        self._fail = fail or mailbox.fail
        self._pending: tuple[MailKey, FrameAssembler] | None = None
        self._view: ShmView | None = None

    def close(self) -> None:
        """Unmaps the peer's area, if any (its doorbell thread ends when the peer closes)."""
        if self._view is not None:
            self._view.close()
            self._view = None

    def feed(self, item: InFrame | stage_pb2.DataFrame) -> bool:
        """Adds one frame; a completed tensor goes to the mailbox. Returns True when a tensor
        was completed and accepted (not stale, not a duplicate).

        Raises:
            WireFormatError: wrong job, epoch or direction, frames out of order, or a bad
                shared-memory offer or slot.
        """
        frame, data = (item.frame, item.data) if isinstance(item, InFrame) else (item, item.data)
        key = self._key(frame.id)
        if frame.HasField("shm_offer"):
            self._take_offer(frame.shm_offer)
            return False
        if frame.HasField("shm_answer"):
            self._reply.on_answer(frame.shm_answer)
            return False
        if frame.HasField("shm_slot"):
            raise WireFormatError("a shared-memory slot arrived on the stream, not the doorbell")
        self._metrics.inc("frames_total", direction="received", kind=self._direction)
        tensor = self._add_frame(key, frame, data)
        return tensor is not None and self._post(key, tensor)

    def _key(self, ident: stage_pb2.MicrobatchId) -> MailKey:
        """The mailbox key of a frame of this stream's job, epoch and direction.

        Raises:
            WireFormatError: another job, epoch or direction.
        """
        if ident.job_id != self._job_id or ident.plan_epoch != self._epoch:
            raise WireFormatError(
                f"frame for job {ident.job_id!r} epoch {ident.plan_epoch}; this stream carries "
                f"job {self._job_id!r} epoch {self._epoch}"
            )
        if _DIRECTIONS.get(ident.direction) != self._direction:
            raise WireFormatError(
                f"frame direction {ident.direction} on a stream carrying {self._direction}"
            )
        return MailKey(ident.run_id, self._direction, ident.microbatch_index)

    def _post(self, key: MailKey, tensor: torch.Tensor) -> bool:
        self._metrics.inc(
            "bytes_total",
            tensor.numel() * tensor.element_size(),
            direction="received",
            kind=self._direction,
        )
        accepted = self._mailbox.put(key, tensor)
        self._metrics.set("queue_depth", len(self._mailbox), queue="mailbox")
        return accepted

    def feed_slot(self, view: ShmView, frame: stage_pb2.DataFrame) -> bool:
        """A doorbell frame: its tensor, the slot of the peer's area itself, to the mailbox.

        Raises:
            WireFormatError: wrong identity, or a malformed header or slot.
        """
        key = self._key(frame.id)
        if not frame.HasField("shm_slot") or frame.data:
            raise WireFormatError(f"{key} on the doorbell must be a shared-memory slot")
        header, slot = frame.header, frame.shm_slot
        if frame.frame_index != 0 or header.num_frames != 1:
            raise WireFormatError(f"{key} on the doorbell must be a single frame")
        check_header(header, self._limits)
        if slot.length != header.num_bytes:
            raise WireFormatError(
                f"{key}'s slot holds {slot.length} bytes; its header says {header.num_bytes}"
            )
        self._metrics.inc("frames_total", direction="received", kind=self._direction)
        # The tensor is the slot's memory itself (no copy); the slot is freed for the sender
        # when the stage drops the tensor.
        raw = view.take(slot.seq, slot.offset, slot.length)
        return self._post(key, view_as_header(raw, header))

    def _add_frame(
        self, key: MailKey, frame: stage_pb2.DataFrame, data: bytes | memoryview
    ) -> torch.Tensor | None:
        if frame.frame_index == 0:
            if self._pending is not None:
                raise WireFormatError(f"{key} started before {self._pending[0]} was complete")
            self._pending = (key, FrameAssembler(frame.header, self._limits))
        if self._pending is None or self._pending[0] != key:
            raise WireFormatError(f"frame {frame.frame_index} of {key} without its frame 0")
        tensor = self._pending[1].add(frame.frame_index, data)
        if tensor is not None:
            self._pending = None
        return tensor

    def _take_offer(self, offer: stage_pb2.ShmOffer) -> None:
        if self._view is not None:
            raise WireFormatError(f"a second shared-memory offer ({offer.name}) on one stream")
        answer = stage_pb2.ShmAnswer(name=offer.name)
        if not self._accept_shm:
            answer.reason = "shared memory is off on this stage (shm_bytes 0)"
        else:
            try:
                self._view = ShmView(offer.name, offer.nonce, offer.size, MAX_AREA_BYTES)
                answer.accepted = True
            except OSError as exc:
                answer.reason = f"cannot map {offer.name}: {exc.strerror or exc}"
        if self._view is not None:
            threading.Thread(
                target=self._read_bell, args=(self._view,), name="doorbell", daemon=True
            ).start()
        self._reply.put(
            stage_pb2.DataFrame(
                id=_ident(self._job_id, self._epoch, _opposite(self._direction)),
                shm_answer=answer,
            )
        )

    def _read_bell(self, view: ShmView) -> None:
        try:
            while (message := view.read_bell()) is not None:
                try:
                    frame = stage_pb2.DataFrame.FromString(message)
                except DecodeError as exc:
                    raise WireFormatError(f"undecodable doorbell frame: {exc}") from None
                accepted = self.feed_slot(view, frame)
                if self._on_delivered is not None:
                    self._on_delivered(accepted)
        except PipesvcError as exc:
            self._fail(exc)
        finally:
            view.close_bell()


def _stream_ends(
    *,
    job_id: str,
    epoch: int,
    sends: str,
    mailbox: Mailbox,
    limits: CodecLimits,
    duplicate_sends: bool,
    shm_bytes: int,
    metrics: Metrics,
    fail: Callable[[PipesvcError], None],
    peer: str,
    on_delivered: Callable[[bool], None] | None = None,
) -> tuple[Sender, FrameReader]:
    """One side of an Exchange stream: a sender for direction ``sends`` and a reader for the
    other, wired so the reader answers shared-memory offers through the sender. With
    ``shm_bytes`` 0 this side neither offers nor maps an area."""
    sender = Sender(
        peer=peer,
        run_aborted=mailbox.is_aborted,
        job_id=job_id,
        epoch=epoch,
        direction=sends,
        copies=2 if duplicate_sends else 1,
        shm_bytes=shm_bytes,
        metrics=metrics,
    )
    reader = FrameReader(
        job_id=job_id,
        epoch=epoch,
        direction=_opposite(sends),
        mailbox=mailbox,
        limits=limits,
        metrics=metrics,
        reply=sender,
        on_delivered=on_delivered,
        fail=fail,
        accept_shm=shm_bytes > 0,
    )
    return sender, reader


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
        self._sender, self._reader = _stream_ends(
            job_id=job_id,
            epoch=epoch,
            sends=ACTIVATION,
            mailbox=mailbox,
            limits=limits,
            duplicate_sends=duplicate_sends,
            shm_bytes=shm_bytes,
            metrics=metrics,
            fail=self._fail,
            peer=f"downstream stage {address}",
        )
        exchange = channel.stream_stream(
            EXCHANGE_METHOD, request_serializer=serialize, response_deserializer=parse
        )
        self._call = exchange(self._sender.frames(), wait_for_ready=True)
        self._thread = threading.Thread(target=self._read, name=f"from-{address}", daemon=True)
        self._thread.start()

    @property
    def uses_shm(self) -> bool:
        """Whether activations now go through shared memory."""
        return self._sender.uses_shm

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        """Sends an activation (waits while the send queue is full; see [Note: bounded
        waits])."""
        self._sender.put((key, tensor.detach()))

    def close(self) -> None:
        """Ends the stream without waiting for the peer; the reader thread exits with it."""
        self._sender.close()
        self._call.cancel()
        self._thread.join(timeout=5)

    def _fail(self, exc: PipesvcError) -> None:
        logger.warning("bad frame from downstream %s: %s", self.address, exc)
        self._mailbox.fail(exc)
        self._call.cancel()

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
            self._fail(exc)
        finally:
            self._sender.close()  # the call is over: later sends fail at once
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
        self._established = threading.Event()
        self.job_id = job_id
        self.epoch = epoch
        self._sender, self._reader = _stream_ends(
            job_id=job_id,
            epoch=epoch,
            sends=GRADIENT,
            mailbox=mailbox,
            limits=limits,
            duplicate_sends=duplicate_sends,
            shm_bytes=shm_bytes,
            metrics=metrics,
            fail=self._fail,
            peer="the upstream stage",
            on_delivered=self._accepted,
        )

    @property
    def uses_shm(self) -> bool:
        """Whether gradients now go through shared memory."""
        return self._sender.uses_shm

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        """Sends a gradient to the upstream stage."""
        self._sender.put((key, tensor.detach()))

    def close(self) -> None:
        """Ends the response side of the stream (never waits)."""
        self._sender.close()

    def serve(
        self, requests: Iterable[InFrame | stage_pb2.DataFrame]
    ) -> Iterator[OutFrame | stage_pb2.DataFrame]:
        """Runs the stream: a thread reads activations, this generator yields gradients.

        Raises:
            PipesvcError: a malformed frame arrived; the stream ends with its status.
        """
        thread = threading.Thread(target=self._read, args=(requests,), daemon=True)
        thread.start()
        try:
            yield from self._sender.frames()
        finally:
            self._sender.close()  # the call ended (or gRPC dropped this generator)

    def _accepted(self, accepted: bool) -> None:
        # Only a stream that delivers a tensor the mailbox accepts (a current run's, not
        # stale, not a duplicate) becomes the link gradients go back on.
        if accepted and not self._established.is_set():
            self._established.set()
            if self._on_established is not None:
                self._on_established(self)

    def _fail(self, exc: PipesvcError) -> None:
        logger.warning("bad frame from upstream: %s", exc)
        self._sender.put(exc)

    def _read(self, requests: Iterable[InFrame | stage_pb2.DataFrame]) -> None:
        try:
            for frame in requests:
                self._accepted(self._reader.feed(frame))
        except PipesvcError as exc:
            self._fail(exc)
            return
        except grpc.RpcError:
            pass  # the upstream went away; its own side reports the failure
        finally:
            self._reader.close()
        self._sender.close()


def add_stage_service(servicer: stage_pb2_grpc.StageServiceServicer, server: grpc.Server) -> None:
    """Registers the stage service on ``server`` with Exchange's frames (de)serialized without
    copying payloads through protobuf (see [Note: frame wire])."""

    class _Capture:
        def __init__(self) -> None:
            self.handlers: dict[str, grpc.RpcMethodHandler] = {}

        def add_generic_rpc_handlers(self, handlers: object) -> None:
            pass

        def add_registered_method_handlers(
            self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
        ) -> None:
            self.handlers = dict(handlers)

    capture = _Capture()
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, capture)
    handlers = capture.handlers
    handlers["Exchange"] = grpc.stream_stream_rpc_method_handler(
        servicer.Exchange, request_deserializer=parse, response_serializer=serialize
    )
    service = EXCHANGE_METHOD.split("/")[1]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
