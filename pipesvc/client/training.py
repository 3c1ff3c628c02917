"""The client's side of training: a step's request (its tensors' bytes beside the message),
sending a step again when its reply was lost in transport, and the pipelined stream of steps
``Job.train`` returns."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sized
from itertools import islice
from typing import TYPE_CHECKING, Any, cast

import grpc
import torch

from pipesvc.errors import InvalidArgumentError, PipesvcError
from pipesvc.v1 import common_pb2, coordinator_pb2
from pipesvc.wire.payload_wire import TRAIN_STEP, Outgoing, Payloads
from pipesvc.wire.rpc_status import ERROR_CLASS_KEY
from pipesvc.wire.step_stream import StepStream

if TYPE_CHECKING:
    from pipesvc.client.connection import Client

TRAIN_STEP_RETRIES = 6
"""Times ``Job.train_step`` sends a step again, under the same request id, after its call
failed in transport (the coordinator restarting, a dropped connection): over about 30 s, and
within the client's ``timeout_s`` from the first try."""
RETRY_PAUSE_S = 0.5
"""Pause before the first such retry; doubles with each."""


def _without_error_class(error: grpc.RpcError, code: grpc.StatusCode) -> bool:
    """The call failed with ``code`` and no error of the coordinator's own."""
    if not hasattr(error, "code") or error.code() != code:
        return False
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    entries = cast("Iterable[tuple[str, str | bytes]]", trailing or ())
    return not any(key == ERROR_CLASS_KEY for key, _ in entries)


def lost_in_transport(error: grpc.RpcError) -> bool:
    """The call failed with UNAVAILABLE and no error of the coordinator's own: it went away
    or the connection dropped, and the step may have run with its reply lost."""
    return _without_error_class(error, grpc.StatusCode.UNAVAILABLE)


def own_deadline(error: grpc.RpcError) -> bool:
    """The call reached its own deadline (not a deadline error of the coordinator's)."""
    return _without_error_class(error, grpc.StatusCode.DEADLINE_EXCEEDED)


def side_inputs(
    attention_mask: torch.Tensor | None, payloads: Payloads
) -> dict[str, common_pb2.Tensor]:
    """A request's side inputs (see [Note: side inputs] in ``pipesvc.core.microbatch``)."""
    return {} if attention_mask is None else {"attention_mask": payloads.tensor(attention_mask)}


def train_request(
    job_id: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    attention_mask: torch.Tensor | None,
    request_id: str,
) -> Outgoing[coordinator_pb2.TrainStepRequest]:
    """A training step's request, its tensors' bytes beside the message (see [Note: payload
    wire]): send with ``TRAIN_STEP.serialize``. The tensors are viewed, not copied, and must
    not change until it is sent (every try of it)."""
    payloads = Payloads()
    message = coordinator_pb2.TrainStepRequest(
        job_id=job_id,
        inputs=payloads.tensor(inputs),
        targets=payloads.tensor(targets),
        side_inputs=side_inputs(attention_mask, payloads),
        request_id=request_id,
    )
    return TRAIN_STEP.outgoing(message, payloads)


def send_step(
    client: Client, request: Outgoing[coordinator_pb2.TrainStepRequest]
) -> coordinator_pb2.TrainStepResponse:
    """``TrainStep``, sent again under its request id while it fails in transport (see
    ``TRAIN_STEP_RETRIES``), within the client's deadline from the first try.

    Raises:
        PipesvcError: the call's typed error.
    """
    deadline = time.monotonic() + client.timeout_s
    for attempt in range(TRAIN_STEP_RETRIES + 1):
        try:
            with client._rpc_errors():
                return client._train_step(request, timeout=max(deadline - time.monotonic(), 0.0))
        except PipesvcError as exc:
            pause = RETRY_PAUSE_S * 2**attempt
            cause = exc.__cause__
            lost = isinstance(cause, grpc.RpcError) and lost_in_transport(cause)
            last = attempt == TRAIN_STEP_RETRIES
            if last or not lost or time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause)
    raise AssertionError("unreachable: the last try returns or raises")


def batch_request(job_id: str, batch: Any) -> Outgoing[coordinator_pb2.TrainStepRequest]:
    """The request of one of ``Job.train``'s batches: an ``(inputs, targets)`` pair, or a
    mapping with ``inputs``, ``targets`` and optionally ``attention_mask``.

    Raises:
        InvalidArgumentError: the batch is neither, or holds something not a tensor.
    """
    if isinstance(batch, Mapping):
        unknown = sorted(set(batch) - {"inputs", "targets", "attention_mask"})
        if unknown or "inputs" not in batch or "targets" not in batch:
            raise InvalidArgumentError(
                f"a batch given as a mapping has keys {sorted(batch)}; expected 'inputs', "
                "'targets' and optionally 'attention_mask'"
            )
        parts = (batch["inputs"], batch["targets"], batch.get("attention_mask"))
    elif isinstance(batch, tuple | list) and len(batch) == 2:
        parts = (batch[0], batch[1], None)
    else:
        raise InvalidArgumentError(
            f"a batch is an (inputs, targets) pair or a mapping with 'inputs' and "
            f"'targets'; got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
        )
    for name, tensor in zip(("inputs", "targets", "attention_mask"), parts, strict=True):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"a batch's {name} is a {type(tensor).__name__}; expected a torch.Tensor"
            )
    return train_request(job_id, parts[0], parts[1], parts[2], uuid.uuid4().hex)


def stream_steps(
    client: Client,
    job_id: str,
    batches: Iterable[Any],
    *,
    steps: int | None,
    progress: bool,
    on_reply: Callable[[coordinator_pb2.TrainStepResponse], None],
) -> Generator[float, None, None]:
    """``Job.train``'s losses: the batches streamed to ``Train`` (see [Note: stream
    reconnect] in ``pipesvc/wire/step_stream.py``), ``on_reply`` called with each reply.

    Raises:
        InvalidArgumentError: ``steps`` is negative.
    """
    if steps is not None and steps < 0:
        raise InvalidArgumentError(f"steps={steps}; expected a count of steps >= 0, or None")
    source: Iterator[Any] = iter(batches) if steps is None else islice(batches, steps)

    def retryable(error: grpc.RpcError, progressed: bool) -> bool:
        return lost_in_transport(error) or (progressed and own_deadline(error))

    stream = StepStream(
        source,
        make_request=lambda batch: batch_request(job_id, batch),
        open_call=lambda requests: client._train(requests, timeout=client.timeout_s),
        on_reply=on_reply,
        convert=client._convert,
        retryable=retryable,
        retries=TRAIN_STEP_RETRIES,
        pause_s=RETRY_PAUSE_S,
    )
    if not progress:
        return stream.losses()
    total = steps
    if isinstance(batches, Sized):
        total = len(batches) if steps is None else min(steps, len(batches))
    return _with_progress(stream.losses(), total)


def _with_progress(
    losses: Generator[float, None, None], total: int | None
) -> Generator[float, None, None]:
    """``losses`` under a tqdm progress bar showing the latest one."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=total, unit="step")
    try:
        for loss in losses:
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            bar.update(1)
            yield loss
    finally:
        bar.close()
        losses.close()
