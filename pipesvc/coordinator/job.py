"""One job on the coordinator: driving its steps and commits, its state, its lifecycle.

The coordinator runs no model code: it plans from a stage's description of the model and moves
only micro-batch inputs, targets, losses and outputs.

[Note: commit] A training step is a prepare phase (RunStep on every stage: forward and backward,
gradients pending) and a commit phase (Commit on every stage). If any stage fails in prepare,
every stage gets Abort and no weights change anywhere. Once Commit is sent, the step counts as
committed: every stage reaches it, or recovery brings them all there before any later call (see
[Note: commit invariant] in commit.py).

[Note: recovery] Before its commit, a step's batch goes to the write-ahead step log. When a
stage is lost (or a step fails for a reason that is not the caller's), the job gets a new plan
(a spare replaces each lost stage, or the model is re-partitioned over the survivors), every
stage is assigned afresh, restores the newest checkpoint, and the logged steps after it are
replayed; then the failed step runs again. Since each step is deterministic, the caller sees
the same losses and weights as a run without the fault.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent import futures
from typing import Any

import torch

from pipesvc import microbatch
from pipesvc.config import JobConfig, config_from_dict, config_to_dict, config_to_proto
from pipesvc.coordinator import planner
from pipesvc.coordinator.commit import commit_all
from pipesvc.coordinator.recovery import JobStorage, RecoveryMixin
from pipesvc.coordinator.registry import StageRegistry
from pipesvc.coordinator.stage_calls import (
    Deadlines,
    StageLostError,
    call_all,
    call_stage,
    health_of,
    stream_stage,
    where,
)
from pipesvc.coordinator.state_db import JobRecord
from pipesvc.coordinator.state_transfer import load_into_stages
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PipesvcError,
    PlanError,
    ResourceExhaustedError,
    StageUnavailableError,
    UnauthenticatedError,
)
from pipesvc.metrics import NO_METRICS, Metrics
from pipesvc.plan import PipelineStage, plan_to_dicts
from pipesvc.tensor_codec import decode, encode
from pipesvc.v1 import common_pb2, coordinator_pb2, stage_pb2

logger = logging.getLogger(__name__)

MAX_RECOVERIES_PER_CALL = 3
"""A step that still fails after this many recoveries raises."""

# Errors that are the caller's (or the plan's) and that a retry cannot fix.
_FINAL_ERRORS = (InvalidArgumentError, ResourceExhaustedError, UnauthenticatedError, PlanError)


class JobDriver(RecoveryMixin):
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
        storage: JobStorage,
        epoch: int = 1,
        step: int = 0,
        run_id: int = 0,
        checkpoint_step: int = -1,
        needs_reconcile: bool = False,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self._metrics = metrics
        self.job_id = job_id
        self.config = config
        self.layers = layers
        self.plan = plan
        self.epoch = epoch
        self.step = step
        self.checkpoint_step = checkpoint_step
        self.recoveries = 0
        self.closed = False
        self._run_id = run_id
        self._registry = registry
        self._deadlines = deadlines
        self._storage = storage
        self._needs_reconcile = needs_reconcile
        self._replay_target: int | None = None
        self._checked_at = 0.0  # when _ensure_ready last found every stage serving
        self._last_loss = (0, 0.0)  # (step, loss) of the newest run phase that succeeded
        # False after an aborted training run: stages that began it zeroed the last committed
        # step's gradients in place, others kept them; none are reported until a commit.
        self._gradients_valid = True
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=16)

    # -- durable state -------------------------------------------------------------------------

    def record(self) -> JobRecord:
        """The job's database row."""
        return JobRecord(
            job_id=self.job_id,
            spec=config_to_dict(self.config),
            plan=plan_to_dicts(self.plan),
            layers=stage_pb2.DescribeResponse(layers=self.layers).SerializeToString(),
            epoch=self.epoch,
            # Mid-replay, the committed count is the replay's target, not where replay is.
            step=max(self.step, self._replay_target or 0),
            run_id=self._run_id,
            checkpoint_step=self.checkpoint_step,
            closed=self.closed,
        )

    @classmethod
    def from_record(
        cls,
        record: JobRecord,
        registry: StageRegistry,
        deadlines: Deadlines,
        storage: JobStorage,
        metrics: Metrics = NO_METRICS,
    ) -> JobDriver:
        """A job read back after a coordinator restart; it reconciles with its stages first."""
        layers = list(stage_pb2.DescribeResponse.FromString(record.layers).layers)
        plan = [PipelineStage(**entry) for entry in record.plan]
        return cls(
            job_id=record.job_id,
            config=config_from_dict(record.spec),
            layers=layers,
            plan=plan,
            registry=registry,
            deadlines=deadlines,
            storage=storage,
            epoch=record.epoch,
            step=record.step,
            run_id=record.run_id,
            checkpoint_step=record.checkpoint_step,
            needs_reconcile=True,
            metrics=metrics,
        )

    def _persist(self) -> None:
        self._storage.db.put_job(self.record())

    # -- calls ---------------------------------------------------------------------------------

    def _call_all(self, method: str, make: Any, timeout_s: float, **kw: Any) -> list[Any]:
        return call_all(self._registry, self.plan, lambda s: (method, make(s)), timeout_s, **kw)

    def _abort(self, run_id: int) -> None:
        request = stage_pb2.AbortRequest(job_id=self.job_id, plan_epoch=self.epoch, run_id=run_id)
        for stage in self.plan:
            try:
                call_stage(self._registry, stage, "Abort", request, self._deadlines.abort_s)
            except PipesvcError as exc:
                logger.warning(
                    "job %s: abort of run %d on %s failed: %s",
                    self.job_id,
                    run_id,
                    where(stage),
                    exc,
                )

    def _run(
        self, mode: int, inputs: list[torch.Tensor], targets: list[torch.Tensor]
    ) -> tuple[int, list[stage_pb2.RunStepResponse]]:
        self._run_id += 1
        run_id = self._run_id
        weights = microbatch.loss_weights([len(t) for t in inputs])
        last = len(self.plan) - 1
        encoded_inputs = [encode(t) for t in inputs]
        encoded_targets = [encode(t) for t in targets]

        def request(stage: PipelineStage) -> stage_pb2.RunStepRequest:
            return stage_pb2.RunStepRequest(
                job_id=self.job_id,
                plan_epoch=self.epoch,
                run_id=run_id,
                mode=mode,
                num_microbatches=len(inputs),
                inputs=encoded_inputs if stage.rank == 0 else [],
                targets=encoded_targets if stage.rank == last else [],
                loss_weights=weights if stage.rank == last and targets else [],
            )

        what = f"run {run_id} (step {self.step + 1})" if targets else f"inference run {run_id}"
        try:
            replies = self._call_all(
                "RunStep", request, self._deadlines.step_s, deadlines=self._deadlines, what=what
            )
        except PipesvcError:
            self._metrics.inc("steps_aborted_total")
            if mode == stage_pb2.TRAIN:
                self._gradients_valid = False
            self._abort(run_id)
            raise
        return run_id, replies

    # -- steps ---------------------------------------------------------------------------------

    def _train_once(
        self,
        input_mbs: list[torch.Tensor],
        target_mbs: list[torch.Tensor],
        log: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> float:
        # The write-ahead log entry is written while the stages compute, and before any commit.
        logged = self._pool.submit(self._storage.log.write, self.step + 1, *log) if log else None
        try:
            run_id, replies = self._run(stage_pb2.TRAIN, input_mbs, target_mbs)
        finally:
            if logged is not None:
                logged.result()
        loss = float(sum(replies[-1].losses))
        self._last_loss = (self.step + 1, loss)
        request = stage_pb2.CommitRequest(job_id=self.job_id, plan_epoch=self.epoch, run_id=run_id)
        if self.config.clip_grad_norm is not None:
            total = math.sqrt(sum(r.grad_norm_sq for r in replies))
            request.grad_scale = min(1.0, self.config.clip_grad_norm / (total + 1e-6))
        try:
            commit_all(
                self._registry, self.plan, request, step=self.step + 1, deadlines=self._deadlines
            )
        except PipesvcError:
            # The step is in the step log: it is committed, and before any later call the
            # stages are rebuilt to it (see [Note: commit invariant]).
            self._replay_target = max(self._replay_target or 0, self.step + 1)
            raise
        self.step += 1
        self._gradients_valid = True
        return loss

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """Runs one training step and commits it on every stage; returns (loss, step).

        A lost stage is recovered from (see [Note: recovery]) and the step still returns. Once
        its commit has started the step counts as committed (see [Note: commit invariant]): if
        this call still fails after that, the next call first rebuilds every stage to it.

        Raises:
            InvalidArgumentError: the batch does not fit the job (nothing changed).
            ResourceExhaustedError, PlanError: recovery is impossible (too little memory, no
                stage left); the message says why.
        """
        if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
            raise InvalidArgumentError(
                f"inputs {list(inputs.shape)} and targets {list(targets.shape)} need the same "
                "batch size in dimension 0"
            )
        m = self.config.num_microbatches
        input_mbs, target_mbs = microbatch.split(inputs, m), microbatch.split(targets, m)
        with self._lock:
            started = time.monotonic()
            target = self.step + 1

            def attempt() -> float:
                if self.step >= target:  # a recovery finished the step's commit by replay
                    assert self._last_loss[0] == target, (self._last_loss, target)
                    return self._last_loss[1]
                return self._train_once(input_mbs, target_mbs, (inputs, targets))

            loss = self._resilient(attempt, f"step {target}")
            self._persist()
            self._metrics.inc("steps_committed_total")
            self._metrics.observe("step_seconds", time.monotonic() - started)
            logger.info(
                "job %s: step %d committed, loss %.6f",
                self.job_id,
                self.step,
                loss,
                extra={"job": self.job_id, "step": self.step},
            )
            every = self.config.checkpoint_every
            if every and self.step % every == 0:
                # The step is committed whatever happens here; a stage lost while it is saved
                # is recovered from (the previous checkpoint and the log are kept till then).
                self._resilient(self._checkpoint, f"checkpoint at step {self.step}")
            return loss, self.step

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Inference on ``inputs`` through the pipeline, micro-batched; survives lost stages.

        Raises:
            InvalidArgumentError: the batch is empty or does not fit the model.
        """
        if inputs.dim() == 0 or inputs.shape[0] == 0:
            raise InvalidArgumentError(f"inputs of shape {list(inputs.shape)} have no batch")
        mbs = microbatch.split(inputs, min(self.config.num_microbatches, inputs.shape[0]))
        with self._lock:
            replies = self._resilient(lambda: self._run(stage_pb2.INFER, mbs, [])[1], "forward")
        return torch.cat([decode(t) for t in replies[-1].outputs], dim=0)

    def _resilient(self, attempt: Any, what: str) -> Any:
        """Runs ``attempt`` after making the job ready; recovers and retries on stage failures."""
        self._check_open()
        # A rebuild left unfinished (a commit that did not reach every stage, or a recovery
        # that gave up mid-replay) is finished before anything else touches the stages.
        lost: set[str] | None = set() if self._replay_target is not None else None
        last: PipesvcError | None = None
        for _ in range(MAX_RECOVERIES_PER_CALL + 1):
            try:
                if lost is not None:
                    self._recover(lost, last)
                    lost = None
                self._ensure_ready()
                return attempt()
            except PipesvcError as exc:
                found = self._lost_stages(exc)
                if found is None:
                    raise
                lost = found if lost is None else lost | found
                last = exc
        raise StageUnavailableError(
            f"job {self.job_id}: {what} failed {MAX_RECOVERIES_PER_CALL + 1} times; last: {last}"
        ) from last

    def _lost_stages(self, error: PipesvcError) -> set[str] | None:
        """The stages to replace after ``error``, or None if it is final (not a stage fault)."""
        if isinstance(error, StageLostError):
            return set(error.addresses)
        if isinstance(error, _FINAL_ERRORS):
            return None
        statuses = health_of(
            self._registry, [s.address for s in self.plan], self._deadlines.health_s
        )
        lost = {a for a, status in statuses.items() if status == "UNREACHABLE"}
        logger.warning(
            "job %s: %s; unreachable stages: %s",
            self.job_id,
            error,
            ", ".join(sorted(lost)) or "none",
        )
        return lost  # empty: a transient fault; rebuild the same plan

    # -- state ---------------------------------------------------------------------------------

    def _stream(self, kind: int) -> Iterator[common_pb2.TensorFrame]:
        for stage in self.plan:
            yield from stream_stage(
                self._registry,
                stage,
                "GetState",
                stage_pb2.GetStateRequest(job_id=self.job_id, kind=kind),
                self._deadlines.control_s,
                deadlines=self._deadlines,
                what=f"reading its state ({common_pb2.StateKind.Name(kind).lower()})",
            )

    def stream_state(self, kind: int) -> Iterator[common_pb2.TensorFrame]:
        """Every stage's tensors in layer order, frame by frame (never the whole model).

        Gradients are the last committed step's; after an aborted training step there are
        none until the next commit (an inference run, aborted or not, leaves them).
        """
        with self._lock:
            self._check_open()
            self._resilient(lambda: None, "reading state")
            if kind == common_pb2.GRADIENTS and not self._gradients_valid:
                return
            yield from self._stream(kind)

    def load_state(self, frames: Iterable[common_pb2.TensorFrame], step: int | None) -> int:
        """Loads a full state (with optimizer state, from a checkpoint): all stages or none.

        Raises:
            InvalidArgumentError: unknown or missing keys, or a shape or dtype mismatch.
        """
        with self._lock:
            self._check_open()
            self._resilient(lambda: None, "loading state")
            count = load_into_stages(
                self._registry,
                self.job_id,
                self.plan,
                self.layers,
                frames,
                timeout_s=self._deadlines.control_s,
                step=step,
                pool=self._pool,
            )
            if step is not None:
                self.step = step
            self._checkpoint()  # recovery must restore the loaded state, not the seed's
            return count

    # -- lifecycle -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPreconditionError(f"job {self.job_id} is closed")

    def _plan_text(self) -> str:
        return ", ".join(f"[{s.start_layer},{s.end_layer})@{s.address}" for s in self.plan)

    def close(self) -> None:
        """Frees the job's stages (best effort on each)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for stage in self.plan:
                self._release(stage)
            self._registry.release(self.job_id)
            self._persist()
            self._pool.shutdown(wait=False)

    def maintain(self) -> None:
        """Between steps: finishes a pending reconcile, moves layers off leaving stages and
        recovers from lost ones, so an idle job is ready and a stopping stage can exit.

        Does nothing while a step holds the job.
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self.closed:
                self._resilient(lambda: None, "maintenance")
        except PipesvcError as exc:
            logger.warning("job %s: maintenance failed: %s", self.job_id, exc)
        finally:
            self._lock.release()

    def wait_idle(self) -> None:
        """Blocks until no step is in flight (for a graceful coordinator stop)."""
        with self._lock:
            pass

    def trace(self, max_runs: int) -> coordinator_pb2.JobTrace:
        """Every stage's recent timed actions."""
        with self._lock:
            self._check_open()
            request = common_pb2.GetTraceRequest(job_id=self.job_id, max_runs=max_runs)
            replies = self._call_all("GetTrace", lambda s: request, self._deadlines.control_s)
        return coordinator_pb2.JobTrace(stages=replies)

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
            recoveries=self.recoveries,
        )


def create_job(
    job_id: str,
    config: JobConfig,
    registry: StageRegistry,
    deadlines: Deadlines,
    storage: JobStorage,
    metrics: Metrics = NO_METRICS,
) -> JobDriver:
    """Plans ``config`` onto free stages and assigns each its layers.

    Raises:
        UnknownModelError: no registered stage can build the model.
        InvalidArgumentError: more stages than layers, or bad model arguments.
        PlanError: fewer free stages than ``num_stages``.
    """
    layers = planner.describe(registry, config, deadlines.control_s)
    plan = planner.first_plan(registry, config, layers, job_id)
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
        storage=storage,
        metrics=metrics,
    )
    try:
        driver._assign()
    except PipesvcError:
        driver.close()
        raise
    driver._persist()
    logger.info("job %s: planned %s over %s", job_id, config.model, driver._plan_text())
    return driver
