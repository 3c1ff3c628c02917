"""A batch request on the coordinator: its tensors decoded from the wire, and its digest.

[Note: step request ids] A client may retry a step whose reply it lost (or that failed after
the step was decided, e.g. writing the job's row). Each TrainStep (and each step of a Train
stream, see [Note: pipelined steps] in train_stream.py) carries a client-chosen request id,
the same on every retry; once a step is decided, its result (step, loss, and a
digest of the batch) is kept under that id in ``JobState.results`` and written to the state
database in the same transaction as the row that records the step as decided, so it survives
a coordinator restart exactly when the step does. A request whose id is remembered is not run:
it gets the first result (after writing it, if the first reply failed before that), and one
that reuses an id for another batch is refused. A retry that arrives while the first attempt
still runs waits for the job's lock and then finds the result. A step that was never decided
(aborted, or lost with a coordinator that died before writing the row) has no result, and its
retry runs it, once.

The one place a TrainStepRequest (or ForwardRequest) becomes tensors, whichever RPC carried it
and however it was encoded (payloads beside the message, see [Note: payload wire], or an old
client's ``Tensor.data``). The tensors of payloads are read-only views of the received bytes:
the coordinator only splits, logs and forwards a batch, and never writes to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pipesvc.coordinator.step_log import LoggedBatch
from pipesvc.core import microbatch
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.tensor_codec import CodecLimits, decode
from pipesvc.errors import InvalidArgumentError, WireFormatError
from pipesvc.v1 import common_pb2, coordinator_pb2
from pipesvc.wire.payload_wire import FORWARD, TRAIN_STEP, Incoming


@dataclass(frozen=True, slots=True)
class StepBatch:
    """A training step as the client sent it."""

    job_id: str
    inputs: torch.Tensor
    targets: torch.Tensor
    side: dict[str, torch.Tensor]
    request_id: str
    message: coordinator_pb2.TrainStepRequest = field(repr=False)
    payloads: Sequence[memoryview] = field(repr=False)

    def digest(self) -> str:
        """SHA-256 of the batch as sent (see ``batch_digest``)."""
        return batch_digest(self.message, self.payloads)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """An inference batch as the client sent it."""

    job_id: str
    inputs: torch.Tensor
    side: dict[str, torch.Tensor]


def _side(
    side: Mapping[str, common_pb2.Tensor], payloads: Sequence[memoryview], limits: CodecLimits
) -> dict[str, torch.Tensor]:
    """A request's side inputs, decoded (checked against the batch by the job)."""
    return {name: decode(t, limits, payloads, copy=False) for name, t in side.items()}


def train_batch(
    request: Incoming[coordinator_pb2.TrainStepRequest]
    | coordinator_pb2.TrainStepRequest
    | WireFormatError,
    limits: CodecLimits,
) -> StepBatch:
    """The step a TrainStep request carries (what ``TRAIN_STEP.parse`` gave the handler, or a
    message protobuf parsed), every tensor checked against ``limits``.

    Raises:
        InvalidArgumentError: inputs or targets are missing.
        WireFormatError: the request or a tensor is malformed.
        ResourceExhaustedError: a tensor exceeds ``limits``.
    """
    received = TRAIN_STEP.received(request)
    message, payloads = received.message, received.payloads
    if not message.HasField("inputs") or not message.HasField("targets"):
        raise InvalidArgumentError("a training step needs both inputs and targets")
    return StepBatch(
        job_id=message.job_id,
        inputs=decode(message.inputs, limits, payloads, copy=False),
        targets=decode(message.targets, limits, payloads, copy=False),
        side=_side(message.side_inputs, payloads, limits),
        request_id=message.request_id,
        message=message,
        payloads=payloads,
    )


def forward_batch(
    request: Incoming[coordinator_pb2.ForwardRequest]
    | coordinator_pb2.ForwardRequest
    | WireFormatError,
    limits: CodecLimits,
) -> ForwardBatch:
    """The batch a Forward request carries, as ``train_batch``.

    Raises:
        InvalidArgumentError: inputs are missing.
        WireFormatError: the request or a tensor is malformed.
        ResourceExhaustedError: a tensor exceeds ``limits``.
    """
    received = FORWARD.received(request)
    message, payloads = received.message, received.payloads
    if not message.HasField("inputs"):
        raise InvalidArgumentError("forward needs inputs")
    return ForwardBatch(
        job_id=message.job_id,
        inputs=decode(message.inputs, limits, payloads, copy=False),
        side=_side(message.side_inputs, payloads, limits),
    )


def batch_digest(
    message: coordinator_pb2.TrainStepRequest, payloads: Sequence[memoryview] = ()
) -> str:
    """SHA-256 of a step's batch as sent (inputs, targets, side inputs by name), which a
    request id is remembered with (see [Note: step request ids] in step_request.py): each tensor's
    header and bytes, wherever they travelled (``Tensor.data`` or a payload), so a retry
    digests the same whichever way either attempt was encoded. Call after ``train_batch``
    accepted the request (the payload indices are checked there)."""
    digest = hashlib.sha256()
    parts = [message.inputs, message.targets]
    for name in sorted(message.side_inputs):
        digest.update(name.encode())
        parts.append(message.side_inputs[name])
    for part in parts:  # the header is small; the payload is hashed where it lies
        body = payloads[part.payload] if part.HasField("payload") else part.data
        for piece in (part.header.SerializeToString(deterministic=True), body):
            digest.update(len(piece).to_bytes(8, "little"))
            digest.update(piece)
    return digest.hexdigest()


MAX_REQUEST_ID = 128
"""The longest request id a TrainStep may carry (see [Note: step request ids])."""


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """A training step checked and split, not run yet (``JobDriver.prepare_step``)."""

    batch: RunBatch
    """Its micro-batches."""
    logged: LoggedBatch
    """What the step log keeps of it."""
    request_id: str
    """The client's id for it (empty: none; see [Note: step request ids])."""

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        logged = self.logged
        tensors = [logged.inputs, logged.targets, *logged.side.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def prepare_step(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    side: Mapping[str, torch.Tensor] | None,
    num_microbatches: int,
    *,
    request_id: str = "",
) -> PreparedStep:
    """A training step checked and split into ``num_microbatches``; touches nothing of the
    job's, so the next step of a stream is prepared while one runs (see [Note: pipelined
    steps]).

    Raises:
        InvalidArgumentError: the batch does not fit, or the request id is too long.
    """
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidArgumentError(
            f"request id {request_id[:32]!r}... has {len(request_id)} characters; at most "
            f"{MAX_REQUEST_ID} are allowed"
        )
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise InvalidArgumentError(
            f"inputs {list(inputs.shape)} and targets {list(targets.shape)} need the same "
            "batch size in dimension 0"
        )
    side = dict(side or {})
    microbatch.check_side(inputs, side)
    return PreparedStep(
        batch=RunBatch.split(inputs, targets, side, num_microbatches),
        logged=LoggedBatch(inputs, targets, side),
        request_id=request_id,
    )
