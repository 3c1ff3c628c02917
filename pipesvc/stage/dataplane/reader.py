"""The receiving direction of an Exchange stream: frames in, whole tensors to the mailbox.

No gRPC here: the link feeds it the frames of its stream (and the doorbell, those of the
shared-memory path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipesvc.core.tensor_codec import CodecLimits, FrameAssembler, check_header, view_as_header
from pipesvc.errors import PipesvcError, WireFormatError
from pipesvc.observe.metrics import Metrics
from pipesvc.stage.dataplane.frame_wire import InFrame
from pipesvc.stage.dataplane.mailbox import NORM_PART, PARTS, Mailbox, MailKey
from pipesvc.stage.dataplane.microbatch_id import DIRECTIONS
from pipesvc.stage.dataplane.sender import Sender
from pipesvc.stage.dataplane.shm import ShmView
from pipesvc.stage.dataplane.shm_handshake import ShmInlet
from pipesvc.v1 import stage_pb2


class FrameReader:
    """Turns incoming frames into whole tensors in a mailbox, checking identity and order.

    It also takes the shared-memory handshake: it answers an offer through ``reply`` (the sender
    of the opposite direction on the same stream), hands the peer's answer to ``reply``, and
    once it has mapped the peer's area hands its doorbell to the mailbox, whose waiting thread
    reads it: each tensor goes to the mailbox and an error to ``fail``. ``on_first_accepted``
    runs once, before the first tensor the mailbox accepts from it becomes visible to a waiter
    (see [Note: the link before the tensor] in pipesvc.stage.net.links).
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
        on_first_accepted: Callable[[], None] | None = None,
        fail: Callable[[PipesvcError], None] | None = None,
        accept_shm: bool = True,
    ) -> None:
        self._metrics = metrics
        self._job_id = job_id
        self._epoch = epoch
        self._direction = direction
        self._mailbox = mailbox
        self._limits = limits
        self._reply = reply
        self._pending: tuple[MailKey, FrameAssembler] | None = None
        self._on_first_accepted = on_first_accepted
        self._shm = ShmInlet(
            job_id=job_id,
            epoch=epoch,
            direction=direction,
            accept_shm=accept_shm,
            reply=reply.put,
            deliver=self.feed_slot,
            fail=fail or mailbox.fail,
            add_source=mailbox.add_source,
            remove_source=mailbox.remove_source,
        )

    def close(self) -> None:
        """Unmaps the peer's area, if any, and stops reading its doorbell."""
        self._shm.close()

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
            self._shm.take_offer(frame.shm_offer)
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
        if DIRECTIONS.get(ident.direction) != self._direction:
            raise WireFormatError(
                f"frame direction {ident.direction} on a stream carrying {self._direction}"
            )
        if ident.part >= PARTS and (ident.part != NORM_PART or ident.microbatch_index != 0):
            raise WireFormatError(
                f"frame part {ident.part} of micro-batch {ident.microbatch_index}; a micro-batch "
                f"has parts 0 and 1, and a run's norm mail is part {NORM_PART} of micro-batch 0"
            )
        return MailKey(ident.run_id, self._direction, ident.microbatch_index, ident.part)

    def _post(self, key: MailKey, tensor: torch.Tensor) -> bool:
        self._metrics.inc(
            "bytes_total",
            tensor.numel() * tensor.element_size(),
            direction="received",
            kind=self._direction,
        )
        if self._on_first_accepted is not None and self._mailbox.accepts(key):
            first, self._on_first_accepted = self._on_first_accepted, None
            first()  # before a waiter can take the tensor
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
            self._pending = (key, FrameAssembler(frame.header, self._limits, borrow=True))
        if self._pending is None or self._pending[0] != key:
            raise WireFormatError(f"frame {frame.frame_index} of {key} without its frame 0")
        tensor = self._pending[1].add(frame.frame_index, data)
        if tensor is not None:
            self._pending = None
        return tensor
