"""The stage's state RPCs: its weights, gradients and checkpoints read out, and state loaded
in two phases (staged, then checked and applied under the run lock)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from pipesvc.core.tensor_codec import CodecLimits, named_frames, read_named_frames
from pipesvc.errors import FailedPreconditionError, InvalidArgumentError
from pipesvc.stage.assignment import Assignment
from pipesvc.stage.options import StageOptions
from pipesvc.v1 import common_pb2, stage_pb2
from pipesvc.wire.rpc_status import handle_errors

_STATE_KINDS = {
    common_pb2.PARAMETERS: "parameters",
    common_pb2.GRADIENTS: "gradients",
    common_pb2.CHECKPOINT: "checkpoint",
}


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class StateRpcs:
    """GetState, LoadState and ApplyState of ``StageService``, which provides the job lookup,
    the options and the tensor codec."""

    _options: StageOptions
    _codec: CodecLimits

    def _current(self, job_id: str, epoch: int | None = None) -> Assignment:
        raise NotImplementedError

    @handle_errors
    def GetState(
        self, request: stage_pb2.GetStateRequest, context: object
    ) -> Iterator[common_pb2.TensorFrame]:
        job = self._current(request.job_id)
        if request.kind not in _STATE_KINDS:
            raise InvalidArgumentError(
                f"state kind {request.kind} must be PARAMETERS, GRADIENTS or CHECKPOINT"
            )
        if request.HasField("snapshot_step"):
            yield from self._stream_snapshot(job, request)
            return
        with job.engine.run_lock:
            tensors = job.runtime.tensors(_STATE_KINDS[request.kind])

        # One tensor copied at a time (under the run lock, so never mid-commit), not the whole
        # state up front: a stage's peak while it is saved grows by one tensor, not by all of
        # its weights and optimizer state. The coordinator runs no step while it reads state.
        def copied(live: torch.Tensor) -> torch.Tensor:
            with job.engine.run_lock:
                return live.to("cpu", copy=True)

        checkpoint = request.kind == common_pb2.CHECKPOINT
        yield from self._state_frames(job, job.runtime.step, tensors, copied, checkpoint)

    def _state_frames(
        self,
        job: Assignment,
        step: int,
        tensors: dict[str, torch.Tensor],
        take: Callable[[torch.Tensor], torch.Tensor],
        checkpoint: bool,
    ) -> Iterator[common_pb2.TensorFrame]:
        """Frames of ``tensors``, each as ``take`` gives it; a checkpoint's pass the
        ``checkpoint`` fault point before each tensor."""
        fault = self._options.fault_kill if checkpoint else None
        for index, (name, tensor) in enumerate(tensors.items()):
            if fault is not None:
                fault.check(
                    when="checkpoint",
                    step=step,
                    rank=job.runtime.rank,
                    microbatch=index,
                    last_mb=len(tensors) - 1,
                )
            yield from named_frames(name, take(tensor))

    def _stream_snapshot(
        self, job: Assignment, request: stage_pb2.GetStateRequest
    ) -> Iterator[common_pb2.TensorFrame]:
        """The copy a carried commit took (see [Note: snapshot checkpoint] in engine.py),
        streamed without the run lock while later runs train; dropped once sent."""
        if request.kind != common_pb2.CHECKPOINT:
            raise InvalidArgumentError("snapshot_step is for the CHECKPOINT state kind only")
        snapshot = job.engine.snapshot
        if snapshot is None or snapshot.step != request.snapshot_step:
            held = "none" if snapshot is None else f"step {snapshot.step}"
            raise FailedPreconditionError(
                f"no snapshot of step {request.snapshot_step} on this stage (it holds {held})"
            )
        yield from self._state_frames(job, snapshot.step, snapshot.tensors, _as_is, True)
        job.engine.drop_snapshot(snapshot.step)

    @handle_errors
    def LoadState(
        self, request_iterator: Iterable[stage_pb2.LoadStateRequest], context: object
    ) -> stage_pb2.LoadStateResponse:
        staged: dict[str, torch.Tensor] = {}
        job: Assignment | None = None

        def frames() -> Iterator[common_pb2.TensorFrame]:
            nonlocal job
            for request in request_iterator:
                job = job or self._current(request.job_id)
                if request.job_id != job.job_id:
                    raise InvalidArgumentError(
                        f"state stream switched from job {job.job_id!r} to {request.job_id!r}"
                    )
                yield request.frame

        for name, tensor in read_named_frames(frames(), self._codec):
            if name in staged:
                raise InvalidArgumentError(f"tensor {name!r} sent twice")
            staged[name] = tensor
        if job is not None:
            with job.engine.run_lock:
                job.staged = staged
        return stage_pb2.LoadStateResponse(num_tensors=len(staged))

    @handle_errors
    def ApplyState(
        self, request: stage_pb2.ApplyStateRequest, context: object
    ) -> stage_pb2.ApplyStateResponse:
        job = self._current(request.job_id)
        with job.engine.run_lock:
            if request.check:
                # The prepared state is dropped: handed over, the optimizer's tensors are not
                # copied, which would hold them twice on a stage restored to its budget.
                job.runtime.check_state(job.staged, owned=True)
                return stage_pb2.ApplyStateResponse()
            staged, job.staged = job.staged, {}
            if request.apply:
                step = request.step if request.HasField("step") else None
                job.runtime.load_state(job.runtime.check_state(staged, owned=True), step)
        return stage_pb2.ApplyStateResponse()
