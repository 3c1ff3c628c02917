"""Both ends of the shared-memory handshake on an Exchange stream (no gRPC here).

The sending end (``ShmOutlet``) creates an area, offers it on the stream and, once the peer
accepts, writes tensors into it and rings the doorbell; the receiving end (``ShmInlet``) maps an
offered area, answers, and registers the doorbell with the mailbox, whose waiting thread reads
it. See [Note: the shared-memory path] in pipesvc.stage.dataplane.shm and [Note: the waiter reads
the doorbell] in pipesvc.stage.dataplane.mailbox.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from google.protobuf.message import DecodeError

from pipesvc.core.tensor_codec import make_header
from pipesvc.errors import PipesvcError, StepAbortedError, WireFormatError
from pipesvc.observe.metrics import Metrics
from pipesvc.stage.dataplane.mailbox import MailKey, MailSource
from pipesvc.stage.dataplane.microbatch_id import microbatch_id, opposite
from pipesvc.stage.dataplane.shm import MAX_AREA_BYTES, ShmArea, ShmView
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)


class ShmOutlet:
    """The sender's end: its area, the offer, the peer's answer, and writes to the area."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        direction: str,
        copies: int,
        shm_bytes: int,
        metrics: Metrics,
        run_aborted: Callable[[int], bool],
        while_full: Callable[[], None] = lambda: None,
    ) -> None:
        self._job_id = job_id
        self._epoch = epoch
        self._direction = direction
        self._copies = copies
        self._shm_bytes = shm_bytes
        self._metrics = metrics
        self._run_aborted = run_aborted
        self._while_full = while_full
        self._area: ShmArea | None = None
        self.bell_open = False
        """Whether the peer accepted: tensors go through the area now."""

    def offer(self, ended: Callable[[], bool]) -> stage_pb2.DataFrame | None:
        """Creates the area and returns the frame offering it (None: no area, or ``ended()``
        became true meanwhile)."""
        if self._shm_bytes <= 0:
            return None
        self._area = ShmArea.create(self._shm_bytes)
        if self._area is None:
            return None
        if ended():  # closed while the area was made: close() missed it
            self._area.close()
            return None
        return stage_pb2.DataFrame(
            id=microbatch_id(self._job_id, self._epoch, self._direction),
            shm_offer=stage_pb2.ShmOffer(
                name=self._area.name, nonce=self._area.nonce, size=self._area.size
            ),
        )

    def on_answer(self, answer: stage_pb2.ShmAnswer) -> None:
        """The receiver's answer to the offer (called from the reading thread)."""
        area = self._area
        if area is None or answer.name != area.name:
            return
        if answer.accepted and area.open_bell():
            self.bell_open = True
        else:
            logger.info(
                "shared memory refused by the peer (%s); sending frames",
                answer.reason or "doorbell not open",
            )
        area.unlink()

    def close(self) -> None:
        """Closes the area (wakes a ``ring`` waiting on a full doorbell); any thread."""
        area = self._area
        if area is not None:
            area.close()

    def send(self, key: MailKey, tensor: torch.Tensor) -> bool:
        """Writes ``tensor`` into one slot of the area and rings the doorbell; False when the
        area has no room now (or the receiver is gone), so the caller queues frames instead.
        It never waits for room: the receiver may hold slots until its backward.

        Raises:
            StepAbortedError: the run was aborted while the doorbell was full.
        """
        area = self._area
        if area is None:
            return False
        header = make_header(tensor)
        ident = microbatch_id(self._job_id, self._epoch, self._direction, key)

        def cancelled() -> bool:
            # The doorbell is full: the peer has not read it yet. This stage reads its own
            # meanwhile, since the peer may itself be waiting for room in one of them (see
            # [Note: the waiter reads the doorbell]).
            self._while_full()
            return self._run_aborted(key.run_id)

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
                rung = area.ring(frame.SerializeToString(), cancelled)
            except OSError as exc:
                # The receiver closed its end: it is gone; the stream reports why.
                logger.info("doorbell to the peer failed (%s); sending frames", exc)
                self.bell_open = False
                return copy > 0
            if not rung:  # nothing was written: the slot goes back, the link stays usable
                area.retract()
                raise StepAbortedError(f"run {key.run_id} was aborted while sending {key}")
            self._metrics.inc("frames_total", direction="sent", kind=key.direction)
            self._metrics.inc("bytes_total", header.num_bytes, direction="sent", kind=key.direction)
        return True


class ShmInlet:
    """The receiver's end: maps an offered area, answers through ``reply``, and hands the
    doorbell to ``add_source`` (the mailbox: its waiting thread reads it, handing each frame to
    ``deliver`` (with the view), and an error to ``fail``)."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        direction: str,
        accept_shm: bool,
        reply: Callable[[stage_pb2.DataFrame], None],
        deliver: Callable[[ShmView, stage_pb2.DataFrame], bool],
        fail: Callable[[PipesvcError], None],
        add_source: Callable[[MailSource], None],
        remove_source: Callable[[MailSource], None],
    ) -> None:
        self._job_id = job_id
        self._epoch = epoch
        self._direction = direction
        self._accept_shm = accept_shm
        self._reply = reply
        self._deliver = deliver
        self._fail = fail
        self._add_source = add_source
        self._remove_source = remove_source
        self._view: ShmView | None = None
        self._doorbell: Doorbell | None = None

    def close(self) -> None:
        """Unmaps the peer's area, if any, and stops reading its doorbell."""
        if self._doorbell is not None:
            self._remove_source(self._doorbell)
            self._doorbell = None
        if self._view is not None:
            self._view.close()
            self._view = None

    def take_offer(self, offer: stage_pb2.ShmOffer) -> None:
        """Maps the offered area if it can and answers.

        Raises:
            WireFormatError: a second offer on the stream, or a bad name or size.
        """
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
            self._doorbell = Doorbell(self._view, self._deliver, self._fail)
            self._add_source(self._doorbell)
        self._reply(
            stage_pb2.DataFrame(
                id=microbatch_id(self._job_id, self._epoch, opposite(self._direction)),
                shm_answer=answer,
            )
        )


class Doorbell:
    """A mapped area's doorbell as a mailbox source (``MailSource``): the thread waiting for
    mail reads it and delivers its tensors."""

    def __init__(
        self,
        view: ShmView,
        deliver: Callable[[ShmView, stage_pb2.DataFrame], bool],
        fail: Callable[[PipesvcError], None],
    ) -> None:
        self._view = view
        self._deliver = deliver
        self._fail = fail

    def fileno(self) -> int:
        return self._view.fileno()

    def drain(self) -> bool:
        """Delivers the messages the doorbell holds; False at its end (the sender closed it or
        died, or the view was closed) or after a bad message (reported to ``fail``)."""
        try:
            messages = self._view.read_ready()
            if messages is None:
                return False
            for message in messages:
                try:
                    frame = stage_pb2.DataFrame.FromString(message)
                except DecodeError as exc:
                    raise WireFormatError(f"undecodable doorbell frame: {exc}") from None
                self._deliver(self._view, frame)
        except PipesvcError as exc:
            self._fail(exc)
            return False
        return True

    def release(self) -> None:
        self._view.close_bell()
