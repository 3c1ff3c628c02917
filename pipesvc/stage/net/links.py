"""The data plane between neighbouring stages: one long-lived bidirectional stream per pair.

The upstream stage opens ``Exchange`` on its downstream neighbour once per job and keeps it:
activation frames flow down the request side, gradient frames come back on the response side.
Encoding and sending run on gRPC's stream threads, fed by bounded queues, so a stage computes
the next micro-batch while the previous one is on the wire. Between stages on one host the
payloads go through shared memory instead (see [Note: the shared-memory path] in
pipesvc.stage.dataplane.shm).

[Note: bounded waits] No wait in the data plane outlives the stream or the run it serves. A
send waits for room in its queue (or the doorbell's pipe) in short polls, and fails at once
with StageUnavailableError once the stream has ended (gRPC stops draining a finished call, so
an unbounded ``put`` would hang the step and, with it, the run lock that Abort needs), and with
StepAbortedError once its run is aborted (Abort wakes a step blocked sending to a hung peer).
Closing a link never blocks: it marks the sender ended and drops what was queued.

[Note: the link before the tensor] The stage sends a micro-batch's gradient back on the
upstream link that delivered its activation, and a stream becomes that link with the first
tensor of it the mailbox accepts. It must become the link *before* that tensor is visible to the
waiting compute thread: otherwise the last stage can run the micro-batch's forward, loss and
backward and send its gradient while the thread that delivered the activation has not yet
established the link ("no upstream stream to send gradients on": the first step of a job or
of a new plan epoch fails, and a healthy job counts a recovery). The window is the few lines
between ``put`` and the establishing call on the delivering thread (a stream's reader thread
for frames), so it showed only under load, in the fault tests. Hence the reader establishes
the link first, once the mailbox says it would accept the tensor (``Mailbox.accepts``), then
puts it.

Each link pairs a ``Sender`` (pipesvc.stage.dataplane.sender) for the direction it sends with a
``FrameReader`` (pipesvc.stage.dataplane.reader) for the other, wired so that the reader answers
shared-memory offers through the sender (pipesvc.stage.dataplane.shm_handshake).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

import grpc
import torch

from pipesvc.core.tensor_codec import CodecLimits
from pipesvc.errors import PipesvcError, StageUnavailableError
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.stage.dataplane.frame_wire import InFrame, OutFrame, parse, serialize
from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
from pipesvc.stage.dataplane.microbatch_id import opposite
from pipesvc.stage.dataplane.reader import FrameReader
from pipesvc.stage.dataplane.sender import Sender
from pipesvc.stage.dataplane.shm import DEFAULT_AREA_BYTES
from pipesvc.v1 import stage_pb2
from pipesvc.wire.rpc_status import error_from_rpc

logger = logging.getLogger(__name__)

EXCHANGE_METHOD = "/pipesvc.v1.StageService/Exchange"


class _Link:
    """One side of an Exchange stream: a sender for direction ``sends`` and a reader for the
    other. With ``shm_bytes`` 0 this side neither offers nor maps an area."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        sends: str,
        mailbox: Mailbox,
        limits: CodecLimits,
        duplicate_sends: bool,
        shm_bytes: int,
        metrics: Metrics,
        peer: str,
        on_first_accepted: Callable[[], None] | None = None,
    ) -> None:
        self._sender = Sender(
            frame_bytes=limits.max_frame_bytes,
            peer=peer,
            run_aborted=mailbox.is_aborted,
            while_full=mailbox.pump,
            job_id=job_id,
            epoch=epoch,
            direction=sends,
            copies=2 if duplicate_sends else 1,
            shm_bytes=shm_bytes,
            metrics=metrics,
        )
        self._reader = FrameReader(
            job_id=job_id,
            epoch=epoch,
            direction=opposite(sends),
            mailbox=mailbox,
            limits=limits,
            metrics=metrics,
            reply=self._sender,
            on_first_accepted=on_first_accepted,
            fail=self._fail,
            accept_shm=shm_bytes > 0,
        )

    @property
    def uses_shm(self) -> bool:
        """Whether what this side sends now goes through shared memory."""
        return self._sender.uses_shm

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        """Sends a tensor (waits while the send queue is full; see [Note: bounded waits])."""
        self._sender.put((key, tensor.detach()))

    def close(self) -> None:
        """Ends the sending side of the stream (never waits)."""
        self._sender.close()

    def _read(self, frames: Iterable[InFrame | stage_pb2.DataFrame]) -> None:
        """Feeds the stream's frames to the reader until it ends; a bad frame goes to
        ``_fail``, a failed call to ``_call_failed``; then ``_finish``."""
        bad_frame = False
        try:
            for frame in frames:
                self._reader.feed(frame)
        except grpc.RpcError as exc:
            self._call_failed(exc)
        except PipesvcError as exc:
            bad_frame = True
            self._fail(exc)
        finally:
            self._finish(bad_frame)

    def _fail(self, exc: PipesvcError) -> None:
        raise NotImplementedError

    def _call_failed(self, exc: grpc.RpcError) -> None:
        raise NotImplementedError

    def _finish(self, bad_frame: bool) -> None:
        raise NotImplementedError


class DownstreamLink(_Link):
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
        super().__init__(
            job_id=job_id,
            epoch=epoch,
            sends=ACTIVATION,
            mailbox=mailbox,
            limits=limits,
            duplicate_sends=duplicate_sends,
            shm_bytes=shm_bytes,
            metrics=metrics,
            peer=f"downstream stage {address}",
        )
        exchange = channel.stream_stream(
            EXCHANGE_METHOD, request_serializer=serialize, response_deserializer=parse
        )
        self._call = exchange(self._sender.frames(), wait_for_ready=True)
        self._thread = threading.Thread(
            target=self._read, args=(self._call,), name=f"from-{address}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Ends the stream without waiting for the peer; the reader thread exits with it."""
        self._sender.close()
        self._call.cancel()
        self._thread.join(timeout=5)

    def _fail(self, exc: PipesvcError) -> None:
        logger.warning("bad frame from downstream %s: %s", self.address, exc)
        self._mailbox.fail(exc)
        self._call.cancel()

    def _call_failed(self, exc: grpc.RpcError) -> None:
        if exc.code() != grpc.StatusCode.CANCELLED:
            error = error_from_rpc(exc, f"stream to downstream stage {self.address}")
            logger.warning("data stream to %s failed: %s", self.address, error)
            self._mailbox.fail(
                StageUnavailableError(f"data stream to {self.address} failed: {error}")
            )

    def _finish(self, bad_frame: bool) -> None:
        self._sender.close()  # the call is over: later sends fail at once
        self._reader.close()


class UpstreamLink(_Link):
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
        super().__init__(
            job_id=job_id,
            epoch=epoch,
            sends=GRADIENT,
            mailbox=mailbox,
            limits=limits,
            duplicate_sends=duplicate_sends,
            shm_bytes=shm_bytes,
            metrics=metrics,
            peer="the upstream stage",
            on_first_accepted=self._establish,
        )

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

    def _establish(self) -> None:
        # Only a stream that delivers a tensor the mailbox accepts (a current run's, not
        # stale, not a duplicate) becomes the link gradients go back on; it does so before
        # a waiter can take that tensor (see [Note: the link before the tensor]).
        if not self._established.is_set():
            self._established.set()
            if self._on_established is not None:
                self._on_established(self)

    def _fail(self, exc: PipesvcError) -> None:
        logger.warning("bad frame from upstream: %s", exc)
        self._sender.put(exc)

    def _call_failed(self, exc: grpc.RpcError) -> None:
        pass  # the upstream went away; its own side reports the failure

    def _finish(self, bad_frame: bool) -> None:
        self._reader.close()
        if not bad_frame:  # else the error queued by _fail ends the stream with its status
            self._sender.close()
