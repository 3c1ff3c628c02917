"""One job on the coordinator: driving its steps and commits, and its lifecycle.

A job is composed of its stages with their plan and epoch (``StageGroup``), the one writer of
its step state and database row (``Ledger``, see [Note: step ledger] in ledger.py), its
checkpoints (``Checkpointer``: cadence, snapshots, the background writer), the ``StepRunner``
that runs its run phases and steps, and the ``Recovery`` that rebuilds the stages from durable
state; ``JobDriver`` takes calls over them under one lock. Its lifecycle between and after
calls (maintenance, settling, stopping, closing) is ``JobLifecycle`` in job_lifecycle.py.

The coordinator runs no model code: it plans from a stage's description of the model and moves
only micro-batch inputs, targets, losses and outputs. How a step commits, is deferred,
recovered and retried: [Note: commit] in commit.py, [Note: deferred commit] in ledger.py,
[Note: recovery] in recovery.py and [Note: step request ids] in step_request.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from typing import Any

import torch

from pipesvc.coordinator.checkpointer import Checkpointer
from pipesvc.coordinator.commit import GroupCommitter
from pipesvc.coordinator.database import MAX_STEP, JobRecord, StepResult
from pipesvc.coordinator.fair_lock import FairLock
from pipesvc.coordinator.generation import JobGeneration
from pipesvc.coordinator.job_counters import JobState
from pipesvc.coordinator.job_lifecycle import JobLifecycle
from pipesvc.coordinator.job_storage import JobStorage
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.rebalance import Replanner
from pipesvc.coordinator.recovery import Recovery
from pipesvc.coordinator.replicas import Rendezvous, RunReplies
from pipesvc.coordinator.stage_calls import Deadlines
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.coordinator.step_request import PreparedStep, prepare_step
from pipesvc.coordinator.step_runner import StepRunner
from pipesvc.coordinator.train_stream import Upcoming
from pipesvc.core import microbatch
from pipesvc.core.config import JobConfig, config_to_proto
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.optim import trains
from pipesvc.core.plan import PipelineStage
from pipesvc.core.planning.measured import Decision
from pipesvc.core.planning.partition import get_partition
from pipesvc.core.tensor_codec import decode
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PipesvcError,
    StageUnavailableError,
)
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.observe.step_lines import StepLines
from pipesvc.v1 import common_pb2, coordinator_pb2, stage_pb2

logger = logging.getLogger(__name__)

INLINE_DIGEST_BYTES = 64 << 10
"""A step's batch up to this size is digested in the step's thread: hashing it takes less
than handing it to another thread (SHA-256 runs at about 1.7 GB/s here)."""

MAX_RECOVERIES_PER_CALL = 3
"""A step that still fails after this many recoveries raises."""


class JobDriver(JobLifecycle):
    """A planned job: its stages (``group``), its step state (``ledger``), its checkpoints, the
    runner of its steps, the ``recovery`` that rebuilds its stages, and the lock that
    serialises its calls."""

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
        record: JobRecord | None = None,
        needs_reconcile: bool = False,
        metrics: Metrics = NO_METRICS,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self._metrics = metrics
        self.job_id = job_id
        self.layers = layers
        self._spec = (config, config_to_proto(config))
        """The configuration ``info`` last described, and its wire form."""
        self._pool = futures.ThreadPoolExecutor(max_workers=16)
        self._step_lines = StepLines(logger, job_id)
        self.group = StageGroup(
            job_id=job_id,
            config=config,
            layers=layers,
            plan=plan,
            epoch=epoch,
            registry=registry,
            deadlines=deadlines,
            pool=self._pool,
            rendezvous=rendezvous,
        )
        self.state = JobState.from_record(record) if record is not None else JobState()
        self.ledger = Ledger(
            shape=self.group,
            state=self.state,
            db=storage.db,
            committer=GroupCommitter(self.group),
            step=record.step if record is not None else 0,
            run_id=record.run_id if record is not None else 0,
            checkpoint_step=record.checkpoint_step if record is not None else -1,
        )
        self.checkpoints = Checkpointer(
            group=self.group, ledger=self.ledger, storage=storage, pool=self._pool
        )
        self.runner = StepRunner(
            group=self.group,
            ledger=self.ledger,
            checkpoints=self.checkpoints,
            log=storage.log,
            metrics=metrics,
        )
        self.recovery = Recovery(
            group=self.group,
            ledger=self.ledger,
            checkpoints=self.checkpoints,
            runner=self.runner,
            storage=storage,
            metrics=metrics,
            needs_reconcile=needs_reconcile,
        )
        self.replanner = Replanner(
            group=self.group,
            ledger=self.ledger,
            checkpoints=self.checkpoints,
            recovery=self.recovery,
        )
        self._lock = FairLock()  # calls take turns (see fair_lock.py)
        self._turn_kept: int | None = None
        """The thread that keeps the lock between two steps of a stream (see ``_step_turn``)."""
        self._ahead: PreparedStep | None = None
        """The step whose run the running step sends ahead."""
        self._stopping = False  # set by wait_idle: the coordinator is stopping
        self.generation = JobGeneration(
            job_id=job_id,
            config=config,
            group=self.group,
            resilient=self._generate_steps,
            run=self.runner.run,
            metrics=metrics,
            orphans=needs_reconcile,
        )

    @property
    def config(self) -> JobConfig:
        """The job's configuration (its partition method changes with ``replan``)."""
        return self.group.config

    @property
    def plan(self) -> list[PipelineStage]:
        """The current plan, in rank order."""
        return self.group.plan

    @property
    def step(self) -> int:
        """Steps committed on the stages as they are now."""
        return self.ledger.step

    @property
    def closed(self) -> bool:
        """True once the job is closed (it is never reopened)."""
        return self.state.closed

    # -- durable state -------------------------------------------------------------------------

    def record(self) -> JobRecord:
        """The job's database row."""
        return self.ledger.record()

    # -- calls ---------------------------------------------------------------------------------

    def prepare_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        side: Mapping[str, torch.Tensor] | None = None,
        *,
        request_id: str = "",
    ) -> PreparedStep:
        """A training step checked and split into micro-batches, ready for ``train_prepared``;
        touches nothing of the job's (no lock), so the next step of a stream is prepared while
        one runs (see [Note: pipelined steps]).

        Raises:
            InvalidArgumentError: the batch does not fit the job, or the request id is too long.
            FailedPreconditionError: the job is an inference job.
        """
        if not trains(self.config.optimizer):
            raise FailedPreconditionError(
                f"job {self.job_id} is an inference job (created with optimizer=None): it holds "
                "no gradients or optimizer state and cannot train; create a job with an "
                "optimizer to train"
            )
        return prepare_step(
            inputs, targets, side, self.config.step_microbatches, request_id=request_id
        )

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        side: Mapping[str, torch.Tensor] | None = None,
        *,
        request_id: str = "",
        digest: Callable[[], str] = str,
    ) -> tuple[float, int]:
        """Runs one training step and decides it on every stage; returns (loss, step).

        ``side``: side inputs by name, split with the batch (see [Note: side inputs]).
        ``request_id`` (empty: none) and ``digest`` (computes one of the batch; on the job's
        pool while the stages run): a step whose id the job remembers is not run again; its
        first result is returned (see [Note: step request ids]).

        A lost stage is recovered from (see [Note: recovery]) and the step still returns. Once
        decided the step counts as committed (see [Note: commit invariant]); its commit is
        applied by the next call (see [Note: deferred commit]), which, if that fails, first
        rebuilds every stage to it.

        Raises:
            InvalidArgumentError: the batch does not fit the job, or the request id is too
                long or was used for another batch (nothing changed).
            StepLogError: the batch could not be logged; the step was aborted everywhere.
            ResourceExhaustedError, PlanError: recovery is impossible (too little memory, no
                stage left); the message says why.
        """
        prepared = self.prepare_step(inputs, targets, side, request_id=request_id)
        return self.train_prepared(prepared, digest)

    def train_prepared(
        self,
        prepared: PreparedStep,
        digest: Callable[[], str] = str,
        ahead: Upcoming[PreparedStep] | None = None,
    ) -> tuple[float, int]:
        """Runs a step ``prepare_step`` made and decides it on every stage; returns (loss,
        step). ``train_step`` and a stream of steps (``pipesvc.coordinator.train_stream``)
        share it, so every step goes through the same guarantees.

        ``ahead`` (a stream's): the next step, once it is ready. If it may, its run goes
        to the stages before this step is decided (see [Note: steps ahead] in
        step_runner.py), and this thread keeps the job's lock for it: its next call must be
        ``train_prepared`` of that step, or ``end_steps``.

        Raises:
            as ``train_step``.
        """
        batch, request_id = prepared.batch, prepared.request_id
        state, ledger, runner = self.state, self.ledger, self.runner
        with self._step_turn(prepared):
            self._check_open()
            if self._stopping:
                raise StageUnavailableError(
                    f"job {self.job_id}: the coordinator is stopping; send the step again to "
                    "its successor (under the same request id)"
                )
            first = state.results.get(request_id) if request_id else None
            if first is not None:
                return self._repeated(first, digest())
            if ledger.committed_step >= MAX_STEP:
                raise FailedPreconditionError(
                    f"job {self.job_id} is at step {ledger.committed_step}, the largest the "
                    "coordinator's database holds; load a state with a smaller step to train on"
                )
            started = time.monotonic()
            target = ledger.step + 1
            digested: futures.Future[str] | None = None
            if request_id and prepared.nbytes <= INLINE_DIGEST_BYTES:
                digested = futures.Future()
                digested.set_result(digest())
            elif request_id:
                digested = self._pool.submit(digest)  # off the step's path

            def attempt() -> float:
                if ledger.step >= target:  # a recovery finished the step's commit by replay
                    assert runner.last_loss[0] == target, (runner.last_loss, target)
                    return runner.last_loss[1]
                return runner.train(batch, prepared.logged, self._next_batch(ahead))

            loss = self._resilient(attempt, f"step {target}")
            if digested is not None:
                result = StepResult(
                    request_id=request_id, step=target, loss=loss, digest=digested.result()
                )
                state.remember(result)
            ledger.persist()  # with the result: decided and remembered at once
            self._metrics.inc("steps_committed_total")
            took = time.monotonic() - started
            self._metrics.observe("step_seconds", took)
            self._step_lines.committed(ledger.step, loss)
            self.checkpoints.after_step(took)  # a snapshot if the step is due a checkpoint
            self._rebalance_if_due(took)
            return loss, ledger.step

    def _next_batch(self, ahead: Upcoming[PreparedStep] | None) -> Upcoming[RunBatch] | None:
        """``StepRunner.train``'s ``ahead``: the stream's next step, unless another call waits
        for the job or the step is a repeat (its request id remembered: it must not run)."""
        if ahead is None:
            return None

        def next_batch(step: PreparedStep) -> RunBatch | None:
            if self._lock.contended():
                return None
            if step.request_id and step.request_id in self.state.results:
                return None
            self._ahead = step
            return step.batch

        return ahead.map(next_batch)

    @contextlib.contextmanager
    def _step_turn(self, prepared: PreparedStep) -> Iterator[None]:
        """The job's lock for a training step: taken, or kept from the step before, whose
        call sent this one's run ahead; kept at the end when this step sent the next one's
        run ahead (see [Note: steps ahead] in step_runner.py)."""
        me = threading.get_ident()
        if self._turn_kept == me:
            self._turn_kept = None
            if self._ahead is not prepared:
                self._end_ahead()
        else:
            self._lock.acquire()
        self._ahead = None
        kept = False
        try:
            yield
            kept = self._ahead is not None and self.runner.sent_ahead is self._ahead.batch
        finally:
            if kept:
                self._turn_kept = me
            else:
                self._give_turn()

    def end_steps(self) -> None:
        """A stream of steps ended: the run it sent ahead, if any, is aborted (its commit
        completed where still pending) and the job's lock given back."""
        if self._turn_kept == threading.get_ident():
            self._give_turn()

    def _give_turn(self) -> None:
        """Drops a run sent ahead, if any, and releases the job's lock."""
        self._turn_kept = None
        self._ahead = None
        try:
            self._end_ahead()
        finally:
            self._lock.release()

    def _end_ahead(self) -> None:
        """``StepRunner.drop_ahead``; a commit that fails there leaves its step the replay
        target, which the next call rebuilds to, so the error is only logged."""
        try:
            self.runner.drop_ahead()
        except PipesvcError as exc:
            logger.warning("job %s: ending a run sent ahead: %s", self.job_id, exc)

    def _repeated(self, first: StepResult, digest: str) -> tuple[float, int]:
        """The reply to a step whose request id the job remembers (see [Note: step request
        ids]): its first result, written first if its first reply failed before that.

        Raises:
            InvalidArgumentError: the id was used for another batch.
        """
        if first.digest != digest:
            raise InvalidArgumentError(
                f"request id {first.request_id!r} was step {first.step} of job {self.job_id} "
                "with another batch; a retried step must send the same batch, and a new step "
                "a new request id"
            )
        if any(r is first for r in self.state.unsaved):
            self.ledger.persist()
        logger.info(
            "job %s: request %s repeats step %d; returning its result without running it",
            self.job_id,
            first.request_id,
            first.step,
            extra={"job": self.job_id, "step": first.step},
        )
        return first.loss, first.step

    def replan(self, partition: str) -> Decision:
        """Moves the job's layers to the plan ``partition`` gives, between two steps (see
        [Note: replan] in rebalance.py); survives lost stages like any call.

        Raises:
            InvalidArgumentError: ``partition`` is not a registered method.
            FailedPreconditionError: the job is closed, or ``throughput`` has no timings yet.
            ResourceExhaustedError: the method's plan does not fit the stages' memory.
        """
        get_partition(partition)  # an unknown name raises before the job is touched
        if self.config.data_parallel > 1 or self.config.virtual_stages > 1:
            raise FailedPreconditionError(
                f"job {self.job_id} has {self.config.data_parallel} replicas and "
                f"{self.config.virtual_stages} layer ranges per stage: re-planning a replicated "
                "or interleaved job is not supported"
            )
        with self._lock:
            self._resilient(lambda: None, "replan")  # a pending recovery or reconcile first
            # Asked for by the user: every link is probed now (the network may have changed).
            decision = self.replanner.choose(partition, probe_again=True)
            self._resilient(lambda: self.replanner.apply(decision), f"replan ({partition})")
            if decision.moved and self.group.plan == decision.plan:
                self.replanner.settler.replanned(self.group.epoch)
            return decision

    def _rebalance_if_due(self, took: float) -> None:
        """After a committed step that took ``took`` seconds: measures and moves when the
        re-planner says so (``Replanner.rebalance_due``; see [Note: replan] in rebalance.py).
        A failed measurement or move is logged and training goes on."""
        step, group, replanner = self.ledger.step, self.group, self.replanner
        started = time.monotonic()
        try:
            due = replanner.rebalance_due(took)
            if due is None:
                return
            decision, verdict = due
            if verdict.move:
                self.runner.drop_ahead()  # the move reassigns the stages
                self._resilient(
                    lambda: replanner.apply(decision, keep_partition=True),
                    f"rebalance at step {step}",
                )
                if group.plan == decision.plan:
                    replanner.settler.moved(group.epoch, time.monotonic() - started)
        except PipesvcError as exc:
            logger.warning("job %s: no rebalance at step %d: %s", self.job_id, step, exc)
            return
        logger.info(
            "job %s: measured at step %d (%s); slowest stage %.2f ms per micro-batch, %s",
            self.job_id,
            step,
            verdict.reason,
            1e3 * max(decision.current_s),
            f"moved (predicted {1e3 * max(decision.predicted_s):.2f} ms)"
            if verdict.move
            else "plan kept",
        )

    def forward(
        self, inputs: torch.Tensor, side: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Inference on ``inputs`` (with ``side`` inputs, see [Note: side inputs]) through the
        pipeline, micro-batched; survives lost stages.

        Raises:
            InvalidArgumentError: the batch is empty or does not fit the model.
        """
        if inputs.dim() == 0 or inputs.shape[0] == 0:
            raise InvalidArgumentError(f"inputs of shape {list(inputs.shape)} have no batch")
        side = dict(side or {})
        microbatch.check_side(inputs, side)
        with self._lock:

            def attempt() -> RunReplies:
                # Micro-batches for every replica of the plan at the time (one may be dropped).
                m = self.config.num_microbatches * len(self.group.pipelines)
                batch = RunBatch.split(inputs, None, side, min(m, inputs.shape[0]))
                return self.runner.run(stage_pb2.INFER, batch)[1]

            replies = self._resilient(attempt, "forward")
        return torch.cat([decode(t) for t in replies.outputs], dim=0)

    # -- generation ------------------------------------------------------------------------------

    def _generate_steps(self, attempt: Callable[[], Any], what: str) -> Any:
        """A generation run: under the job's lock, recovering from lost stages like any run.

        Raises:
            FailedPreconditionError: the job's stages hold several layer ranges each.
        """
        if self.config.virtual_stages > 1:
            raise FailedPreconditionError(
                f"job {self.job_id} holds {self.config.virtual_stages} layer ranges per stage: "
                "generation through virtual stages is not supported; create the job without "
                "virtual_stages to generate"
            )
        with self._lock:
            return self._resilient(attempt, what)

    def _resilient(self, attempt: Any, what: str) -> Any:
        """Runs ``attempt`` after making the job ready; recovers and retries on stage failures."""
        self._check_open()
        recovery = self.recovery
        # A rebuild left unfinished (a commit that did not reach every stage, or a recovery
        # that gave up mid-replay) is finished before anything else touches the stages.
        lost: set[str] | None = set() if self.ledger.replay_target is not None else None
        last: PipesvcError | None = None
        for _ in range(MAX_RECOVERIES_PER_CALL + 1):
            try:
                if lost is not None:
                    recovery.recover(lost, last)
                    lost = None
                recovery.ensure_ready()
                return attempt()
            except PipesvcError as exc:
                found = recovery.lost_after(exc)
                if found is None:
                    raise
                lost = found if lost is None else lost | found
                last = exc
        raise StageUnavailableError(
            f"job {self.job_id}: {what} failed {MAX_RECOVERIES_PER_CALL + 1} times; last: {last}"
        ) from last

    # -- state ---------------------------------------------------------------------------------

    def stream_state(
        self, kind: common_pb2.StateKind.ValueType
    ) -> Iterator[common_pb2.TensorFrame]:
        """Every stage's tensors in layer order, frame by frame (never the whole model).

        Gradients are the last committed step's; after an aborted training step there are
        none until the next commit (an inference run, aborted or not, leaves them).
        """
        with self._lock:
            self._check_open()
            self._resilient(self.checkpoints.flush, "reading state")
            if kind == common_pb2.GRADIENTS and not self.ledger.gradients_valid:
                return
            yield from self.group.stream_state(kind)

    def load_state(self, frames: Iterable[common_pb2.TensorFrame], step: int | None) -> int:
        """Loads a full state (with optimizer state, from a checkpoint): all stages or none.

        ``step`` (None: the job's stays) sets the committed-step counter. A step below the
        job's starts a new lineage: the checkpoint of the loaded state replaces every newer
        one, and the logged steps after it are dropped (see ``Checkpointer.start_lineage``).

        Raises:
            InvalidArgumentError: unknown or missing keys, a shape or dtype mismatch, or a
                step outside [0, 2^63-1] (checked before any stage is called).
        """
        if step is not None and not 0 <= step <= MAX_STEP:
            raise InvalidArgumentError(
                f"step {step} is out of range: a job's step must be between 0 and {MAX_STEP} "
                "(2^63-1, the largest the coordinator's database holds)"
            )
        with self._lock:
            self._check_open()
            self._resilient(self.checkpoints.flush, "loading state")
            count = self.group.load_state(frames, step)
            self.checkpoints.start_lineage(step)  # recovery must restore the loaded state
            return count

    # -- description ---------------------------------------------------------------------------

    def trace(self, max_runs: int) -> coordinator_pb2.JobTrace:
        """Every stage's recent timed actions."""
        with self._lock:
            self._check_open()
            request = common_pb2.GetTraceRequest(job_id=self.job_id, max_runs=max_runs)
            replies = self.group.call_all(
                lambda stub: stub.GetTrace, lambda s: request, self.group.deadlines.control_s
            )
            for stage, reply in zip(self.group.servers, replies, strict=True):
                reply.replica = stage.replica
        return coordinator_pb2.JobTrace(stages=replies)

    def info(self) -> coordinator_pb2.JobInfo:
        """The job's wire description (every reply about the job carries it, each step's
        too: its spec is made once per configuration)."""
        config, spec = self._spec
        if config is not self.config:
            config, spec = self._spec = self.config, config_to_proto(self.config)
        return coordinator_pb2.JobInfo(
            job_id=self.job_id,
            spec=spec,
            plan_epoch=self.group.epoch,
            plan=self.group.plan_protos(),
            step=self.ledger.step,
            num_layers=len(self.layers),
            recoveries=self.state.recoveries,
            checkpoint_step=max(self.ledger.checkpoint_step, 0),
        )
