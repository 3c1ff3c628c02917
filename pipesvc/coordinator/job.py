"""One job on the coordinator: planning it onto stages, and driving its steps and state.

The coordinator runs no model code: it plans from a stage's description of the model and moves
only micro-batch inputs, targets, losses and outputs. [Note: commit] A training step is a
prepare phase (RunStep on every stage: forward and backward, gradients pending) and a commit
phase (Commit on every stage). If any stage fails in prepare, every stage gets Abort and no
weights change anywhere.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from pipesvc import microbatch, partition, schedule
from pipesvc.config import JobConfig, config_to_proto
from pipesvc.coordinator.registry import StageRecord, StageRegistry
from pipesvc.errors import (
    InternalError,
    InvalidArgumentError,
    PipesvcError,
    PlanError,
    StepAbortedError,
    UnknownModelError,
)
from pipesvc.plan import PipelineStage, check_plan
from pipesvc.rpc_status import error_from_rpc
from pipesvc.tensor_codec import decode, encode
from pipesvc.transport import call
from pipesvc.v1 import common_pb2, coordinator_pb2, stage_pb2

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Deadlines:
    """Deadlines of the coordinator's outbound calls."""

    control_s: float = 120.0
    """Assign, commit, abort, release and state calls."""
    step_s: float = 600.0
    """One RunStep (a whole pipelined step on one stage)."""


def where(stage: PipelineStage) -> str:
    """How errors name a stage: its rank and address."""
    return f"stage rank {stage.rank} ({stage.address})"


def call_stage(
    registry: StageRegistry, stage: PipelineStage, method: str, request: Any, timeout_s: float
) -> Any:
    """Calls ``method`` on a stage with a deadline; errors keep their class and name the stage.

    Raises:
        PipesvcError: what the stage raised, or StageUnavailableError if it was unreachable.
    """
    stub = registry.stub(stage.address)
    try:
        return call(getattr(stub, method), request, timeout_s=timeout_s, where=where(stage))
    except PipesvcError as exc:
        if where(stage) in str(exc):
            raise
        raise type(exc)(f"{where(stage)}: {exc}") from exc


class JobDriver:
    """A planned job: its plan on stage servers and the lock that serialises its steps."""

    def __init__(
        self,
        *,
        job_id: str,
        config: JobConfig,
        layers: list[stage_pb2.LayerDescription],
        plan: list[PipelineStage],
        registry: StageRegistry,
        deadlines: Deadlines,
    ) -> None:
        self.job_id = job_id
        self.config = config
        self.layers = layers
        self.plan = plan
        self.epoch = 1
        self.step = 0
        self._run_id = 0
        self._registry = registry
        self._deadlines = deadlines
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=2 * len(plan) + 2)
        self.closed = False

    # -- calls on every stage ------------------------------------------------------------------

    def _where(self, stage: PipelineStage) -> str:
        return where(stage)

    def _on_stage(self, stage: PipelineStage, method: str, request: Any, timeout_s: float) -> Any:
        return call_stage(self._registry, stage, method, request, timeout_s)

    def _on_all(
        self,
        make: Callable[[PipelineStage], tuple[str, Any]],
        timeout_s: float,
        on_first_error: Callable[[], None] | None = None,
    ) -> list[Any]:
        pending = {
            self._pool.submit(self._on_stage, stage, *make(stage), timeout_s): stage
            for stage in self.plan
        }
        done, not_done = futures.wait(pending, return_when=futures.FIRST_EXCEPTION)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors and on_first_error is not None:
            on_first_error()
        futures.wait(not_done)
        errors += [f.exception() for f in not_done if f.exception() is not None]
        if errors:
            # The root cause is the first error that is not a consequence of the abort.
            root = next((e for e in errors if not isinstance(e, StepAbortedError)), errors[0])
            assert isinstance(root, BaseException)
            raise root
        by_rank = {pending[f].rank: f.result() for f in pending}
        return [by_rank[rank] for rank in range(len(self.plan))]

    def _abort(self, run_id: int) -> None:
        request = stage_pb2.AbortRequest(job_id=self.job_id, plan_epoch=self.epoch, run_id=run_id)
        for stage in self.plan:
            try:
                self._on_stage(stage, "Abort", request, self._deadlines.control_s)
            except PipesvcError as exc:
                logger.warning(
                    "job %s: abort of run %d on %s failed: %s",
                    self.job_id,
                    run_id,
                    self._where(stage),
                    exc,
                )

    # -- steps ---------------------------------------------------------------------------------

    def _run(
        self, mode: int, inputs: list[torch.Tensor], targets: list[torch.Tensor]
    ) -> tuple[int, list[stage_pb2.RunStepResponse]]:
        self._run_id += 1
        run_id = self._run_id
        weights = microbatch.loss_weights([len(t) for t in inputs])
        last = len(self.plan) - 1
        encoded_inputs = [encode(t) for t in inputs]
        encoded_targets = [encode(t) for t in targets]

        def request(stage: PipelineStage) -> tuple[str, Any]:
            return "RunStep", stage_pb2.RunStepRequest(
                job_id=self.job_id,
                plan_epoch=self.epoch,
                run_id=run_id,
                mode=mode,
                num_microbatches=len(inputs),
                inputs=encoded_inputs if stage.rank == 0 else [],
                targets=encoded_targets if stage.rank == last else [],
                loss_weights=weights if stage.rank == last and targets else [],
            )

        def abort() -> None:
            self._abort(run_id)

        try:
            return run_id, self._on_all(request, self._deadlines.step_s, on_first_error=abort)
        except PipesvcError:
            abort()
            raise

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """Runs one training step and commits it on every stage; returns (loss, step).

        Raises:
            InvalidArgumentError: the batch does not fit the job.
            PipesvcError: a stage failed; the step was aborted everywhere.
        """
        if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
            raise InvalidArgumentError(
                f"inputs {list(inputs.shape)} and targets {list(targets.shape)} need the same "
                "batch size in dimension 0"
            )
        m = self.config.num_microbatches
        input_mbs, target_mbs = microbatch.split(inputs, m), microbatch.split(targets, m)
        with self._lock:
            self._check_open()
            run_id, replies = self._run(stage_pb2.TRAIN, input_mbs, target_mbs)
            scale = None
            if self.config.clip_grad_norm is not None:
                total = math.sqrt(sum(r.grad_norm_sq for r in replies))
                scale = min(1.0, self.config.clip_grad_norm / (total + 1e-6))

            def commit(stage: PipelineStage) -> tuple[str, Any]:
                request = stage_pb2.CommitRequest(
                    job_id=self.job_id, plan_epoch=self.epoch, run_id=run_id
                )
                if scale is not None:
                    request.grad_scale = scale
                return "Commit", request

            try:
                self._on_all(commit, self._deadlines.control_s)
            except PipesvcError as exc:
                raise InternalError(
                    f"job {self.job_id}: commit of step {self.step + 1} failed on a stage after "
                    f"all prepared: {exc}"
                ) from exc
            self.step += 1
            loss = sum(replies[-1].losses)
            logger.info("job %s: step %d committed, loss %.6f", self.job_id, self.step, loss)
            return loss, self.step

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Inference on ``inputs`` through the pipeline, micro-batched.

        Raises:
            InvalidArgumentError: the batch is empty or does not fit the model.
        """
        if inputs.dim() == 0 or inputs.shape[0] == 0:
            raise InvalidArgumentError(f"inputs of shape {list(inputs.shape)} have no batch")
        mbs = microbatch.split(inputs, min(self.config.num_microbatches, inputs.shape[0]))
        with self._lock:
            self._check_open()
            _, replies = self._run(stage_pb2.INFER, mbs, [])
        return torch.cat([decode(t) for t in replies[-1].outputs], dim=0)

    # -- state ---------------------------------------------------------------------------------

    def stream_state(self, kind: int) -> Iterator[common_pb2.TensorFrame]:
        """Every stage's tensors in layer order, frame by frame (never the whole model)."""
        with self._lock:
            self._check_open()
            for stage in self.plan:
                stub = self._registry.stub(stage.address)
                request = stage_pb2.GetStateRequest(job_id=self.job_id, kind=kind)
                try:
                    yield from stub.GetState(request, timeout=self._deadlines.control_s)
                except grpc.RpcError as exc:
                    raise error_from_rpc(exc, self._where(stage)) from exc

    def _stage_of(self, name: str) -> tuple[PipelineStage, stage_pb2.TensorDescription]:
        layer_text, _, rest = name.partition(".")
        if not layer_text.isdigit() or int(layer_text) >= len(self.layers):
            raise InvalidArgumentError(
                f"state key {name!r} does not start with a layer index below {len(self.layers)}"
            )
        layer = int(layer_text)
        for tensor in self.layers[layer].tensors:
            if tensor.name == rest:
                stage = next(s for s in self.plan if s.start_layer <= layer < s.end_layer)
                return stage, tensor
        raise InvalidArgumentError(f"state key {name!r} is not a tensor of layer {layer}")

    def load_state(self, frames: Iterable[common_pb2.TensorFrame]) -> int:
        """Loads a full state_dict: every stage applies it, or none does.

        Raises:
            InvalidArgumentError: unknown or missing keys, or a shape or dtype mismatch.
        """
        expected = {f"{layer.index}.{t.name}" for layer in self.layers for t in layer.tensors}
        with self._lock:
            self._check_open()
            queues = {s.rank: queue.Queue[Any](maxsize=16) for s in self.plan}

            def feed(rank: int) -> Iterator[stage_pb2.LoadStateRequest]:
                while (frame := queues[rank].get()) is not None:
                    yield stage_pb2.LoadStateRequest(job_id=self.job_id, frame=frame)

            calls = {
                s.rank: self._pool.submit(
                    self._on_stage, s, "LoadState", feed(s.rank), self._deadlines.control_s
                )
                for s in self.plan
            }

            def put(rank: int, item: common_pb2.TensorFrame | None) -> None:
                # A stage that refused the stream stops reading: never block on its queue.
                while not calls[rank].done():
                    try:
                        queues[rank].put(item, timeout=0.2)
                        return
                    except queue.Full:
                        continue
                error = calls[rank].exception()
                if item is not None and error is not None:
                    raise error

            seen: set[str] = set()
            failure: BaseException | None = None
            try:
                self._route(frames, put, seen)
            except PipesvcError as exc:
                failure = exc
            finally:
                for rank in queues:
                    put(rank, None)
            futures.wait(calls.values())
            failure = failure or next(
                (c.exception() for c in calls.values() if c.exception()), None
            )
            missing = sorted(expected - seen)
            apply = failure is None and not missing
            self._on_all(
                lambda s: (
                    "ApplyState",
                    stage_pb2.ApplyStateRequest(job_id=self.job_id, apply=apply),
                ),
                self._deadlines.control_s,
            )
            if failure is not None:
                raise failure
            if missing:
                raise InvalidArgumentError(
                    f"state_dict is missing {len(missing)} keys, e.g. {missing[:5]}"
                )
            return len(seen)

    def _route(
        self,
        frames: Iterable[common_pb2.TensorFrame],
        put: Callable[[int, common_pb2.TensorFrame], None],
        seen: set[str],
    ) -> None:
        current: tuple[str, int] | None = None
        for frame in frames:
            if frame.frame_index == 0:
                stage, description = self._stage_of(frame.name)
                header = frame.header
                if list(header.shape) != list(description.shape):
                    raise InvalidArgumentError(
                        f"state tensor {frame.name} has shape {list(header.shape)}; "
                        f"the model's is {list(description.shape)}"
                    )
                if frame.name in seen:
                    raise InvalidArgumentError(f"state key {frame.name!r} sent twice")
                seen.add(frame.name)
                current = (frame.name, stage.rank)
            if current is None or current[0] != frame.name:
                raise InvalidArgumentError(f"frame {frame.frame_index} of {frame.name!r} alone")
            put(current[1], frame)

    # -- lifecycle -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgumentError(f"job {self.job_id} is closed")

    def close(self) -> None:
        """Frees the job's stages (best effort on each)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for stage in self.plan:
                try:
                    self._on_stage(
                        stage,
                        "Release",
                        stage_pb2.ReleaseRequest(job_id=self.job_id),
                        self._deadlines.control_s,
                    )
                except PipesvcError as exc:
                    logger.warning(
                        "job %s: release of %s failed: %s", self.job_id, self._where(stage), exc
                    )
            self._registry.release(self.job_id)
            self._pool.shutdown(wait=False)

    def info(self) -> coordinator_pb2.JobInfo:
        """The job's wire description."""
        return coordinator_pb2.JobInfo(
            job_id=self.job_id,
            spec=config_to_proto(self.config),
            plan_epoch=self.epoch,
            plan=[
                common_pb2.PlanStage(
                    start_layer=s.start_layer, end_layer=s.end_layer, rank=s.rank, address=s.address
                )
                for s in self.plan
            ],
            step=self.step,
            num_layers=len(self.layers),
        )


MAX_SIMULATED_ACTIONS = 1 << 14
"""Largest schedule (stages x micro-batches) dry-run at job creation; bigger ones are trusted."""


def check_schedule(name: str, num_stages: int, num_microbatches: int) -> None:
    """Dry-runs the job's schedule on every stage: order and deadlock freedom.

    Raises:
        InvalidArgumentError: the schedule would deadlock or is malformed.
    """
    if num_stages * num_microbatches > MAX_SIMULATED_ACTIONS:
        return
    schedule.validate(
        [
            schedule.stage_actions(
                name, rank=rank, num_stages=num_stages, num_microbatches=num_microbatches
            )
            for rank in range(num_stages)
        ],
        num_microbatches,
    )


def create_job(
    job_id: str, config: JobConfig, registry: StageRegistry, deadlines: Deadlines
) -> JobDriver:
    """Plans ``config`` onto free stages and assigns each its layers.

    Raises:
        UnknownModelError: no registered stage can build the model.
        InvalidArgumentError: more stages than layers, or bad model arguments.
        PlanError: fewer free stages than ``num_stages``.
    """
    candidates = registry.free(config.model)
    if not candidates:
        known = sorted({m for r in registry.all() for m in r.models})
        if config.model not in known:
            raise UnknownModelError(
                f"model {config.model!r} is not registered on any stage; known models: "
                f"{', '.join(known) or 'none (no stages registered)'}"
            )
        raise PlanError(f"no free stage can build {config.model!r}; all are serving jobs")
    describer = PipelineStage(start_layer=0, end_layer=0, rank=0, address=candidates[0].address)
    reply = call_stage(
        registry,
        describer,
        "Describe",
        stage_pb2.DescribeRequest(model=config.model, model_args_json=config.model_args_json()),
        deadlines.control_s,
    )
    layers = list(reply.layers)
    costs = [int(layer.num_parameters) for layer in layers]
    ranges = partition.partition(config.partition, costs, config.num_stages)
    check_schedule(config.schedule, config.num_stages, config.num_microbatches)
    if config.num_stages > len(candidates):
        raise PlanError(
            f"num_stages ({config.num_stages}) exceeds the free stages that can build "
            f"{config.model!r} ({len(candidates)} of {len(registry.all())} registered)"
        )
    chosen: list[StageRecord] = candidates[: config.num_stages]
    if not registry.claim([r.address for r in chosen], job_id):
        raise PlanError("stages were taken by another job while planning; try again")
    plan = [
        PipelineStage(start_layer=start, end_layer=end, rank=rank, address=record.address)
        for rank, ((start, end), record) in enumerate(zip(ranges, chosen, strict=True))
    ]
    check_plan(plan, len(layers))
    for stage in plan:
        registry.place(
            stage.address, rank=stage.rank, start_layer=stage.start_layer, end_layer=stage.end_layer
        )
    driver = JobDriver(
        job_id=job_id,
        config=config,
        layers=layers,
        plan=plan,
        registry=registry,
        deadlines=deadlines,
    )
    spec = config_to_proto(config)

    def assign(stage: PipelineStage) -> tuple[str, Any]:
        downstream = plan[stage.rank + 1].address if stage.rank + 1 < len(plan) else ""
        return "Assign", stage_pb2.AssignRequest(
            job_id=job_id,
            plan_epoch=driver.epoch,
            spec=spec,
            stage=common_pb2.PlanStage(
                start_layer=stage.start_layer,
                end_layer=stage.end_layer,
                rank=stage.rank,
                address=stage.address,
            ),
            num_stages=len(plan),
            downstream_address=downstream,
        )

    try:
        driver._on_all(assign, deadlines.control_s)
    except PipesvcError:
        driver.close()
        raise
    logger.info(
        "job %s: planned %s over %s",
        job_id,
        config.model,
        ", ".join(f"[{s.start_layer},{s.end_layer})@{s.address}" for s in plan),
    )
    return driver
