"""One run phase on every stage, carrying the pending commit, and one training step up to its
decision (see [Note: commit] and [Note: deferred commit] in ledger.py).

``StepRunner`` is what a call runs and what recovery replays: both go through the same code, so
a replayed step is decided, carried and settled exactly as the step it replays. Every change
of the step state goes through the job's ``Ledger`` (see [Note: step ledger]). It runs with the
job's lock held.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from pipesvc.coordinator.checkpointer import Checkpointer
from pipesvc.coordinator.job_counters import PendingCommit
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.replicas import RunReplies
from pipesvc.coordinator.stage_calls import StageLostError
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.coordinator.step_log import LoggedBatch, StepLog, StepLogError
from pipesvc.core.microbatch import RunBatch
from pipesvc.errors import (
    InvalidArgumentError,
    PipesvcError,
    PlanError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from pipesvc.observe.metrics import Metrics
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)

FINAL_ERRORS = (
    InvalidArgumentError,
    ResourceExhaustedError,
    UnauthenticatedError,
    PlanError,
    StepLogError,
)
"""Errors that are the caller's (or the plan's, or the coordinator's disk's) and that a
recovery cannot fix."""


class StepRunner:
    """Runs a job's run phases and training steps on its stages as they are now."""

    def __init__(
        self,
        *,
        group: StageGroup,
        ledger: Ledger,
        checkpoints: Checkpointer,
        log: StepLog,
        metrics: Metrics,
    ) -> None:
        self._group = group
        self._ledger = ledger
        self._checkpoints = checkpoints
        self._log = log
        self._metrics = metrics
        self.last_loss = (0, 0.0)
        """(step, loss) of the newest training run phase that succeeded."""

    def run(
        self,
        mode: stage_pb2.RunMode.ValueType,
        batch: RunBatch,
        during: Callable[[], None] | None = None,
    ) -> tuple[int, RunReplies]:
        """One run phase on every stage under a new run id, carrying the pending commit (see
        [Note: deferred commit] in ledger.py); aborted everywhere if it fails. ``during``: as
        for ``StageGroup.run_step`` (called once per attempt; it must not raise).

        If a run that carried a commit fails, the commit is settled (completed where it is
        still pending; if that fails, the step becomes the replay target); after a final-class
        error the run is then tried once more without it, so that a refused commit is not
        reported as the run's fault.
        """
        ledger = self._ledger
        if ledger.pending is not None and not all(self._group.shares(mode, len(batch.inputs))):
            # A replica sits this run out, so it cannot carry the commit: flushed first.
            self._checkpoints.flush()
        carried = ledger.pending
        try:
            ran = self._run_once(mode, batch, carried, during)
        except PipesvcError as exc:
            if carried is None:
                raise
            if isinstance(exc, StageLostError):
                # A stage is gone: recovery rebuilds every stage to the decided step.
                ledger.lost(carried)
                raise
            logger.warning(
                "job %s: a run carrying the commit of step %d failed: %s; settling the commit",
                self._group.job_id,
                carried.step,
                exc,
            )
            if carried.snapshot:
                logger.warning(
                    "job %s: the run that carried step %d's checkpoint failed; the next "
                    "periodic checkpoint takes its place",
                    self._group.job_id,
                    carried.step,
                )
            ledger.settle(carried, after_failed_run=True)
            if not isinstance(exc, FINAL_ERRORS):
                raise  # a fault of a stage or link: recovered from as for any run
        else:
            if carried is not None and carried.snapshot:
                # Every stage applied the commit and holds its snapshot: it streams to a
                # checkpoint while later steps train.
                self._checkpoints.stream_snapshot(carried.step)
            return ran
        # A final-class error may have been the carried commit's (settled now), not the run's:
        # the run goes once more on its own, and a caller's error repeats.
        return self._run_once(mode, batch, None, during)

    def _run_once(
        self,
        mode: stage_pb2.RunMode.ValueType,
        batch: RunBatch,
        carried: PendingCommit | None,
        during: Callable[[], None] | None,
    ) -> tuple[int, RunReplies]:
        ledger = self._ledger
        run_id = ledger.begin_run()
        training = mode == stage_pb2.TRAIN
        what = f"run {run_id} (step {ledger.step + 1})" if training else f"inference run {run_id}"
        commit = carried.carried() if carried is not None else None
        self._checkpoints.before_run(carried is not None and carried.snapshot)
        try:
            replies = self._group.run_step(
                run_id, mode, batch, what=what, commit=commit, during=during
            )
        except PipesvcError as exc:
            self._metrics.inc("steps_aborted_total")
            ledger.aborted(training=training)
            lost = exc.addresses if isinstance(exc, StageLostError) else set()
            self._group.abort(run_id, lost=lost)
            raise
        if carried is not None:
            ledger.carried(carried)
        return run_id, replies

    def train(self, batch: RunBatch, log: LoggedBatch | None) -> float:
        """Runs the next training step and decides it (its commit pending, see [Note:
        deferred commit]); returns its loss. ``log``: its batch for the step log, written while
        the stages compute (None: a replayed step, logged already).

        Raises:
            StepLogError: the batch could not be logged; the step was aborted everywhere.
            PipesvcError: the run failed (aborted everywhere).
        """
        ledger, group = self._ledger, self._group
        # The write-ahead log entry is written while the stages compute (in this thread, once
        # every stage has its run: no hop to another thread), and before any commit. If the
        # run fails, the run's error is the one to report; the entry is written again before
        # the step is ever decided.
        logged = _LogWrite(self._log, ledger.step + 1, log) if log else None
        run_id, replies = self.run(stage_pb2.TRAIN, batch, logged)
        if logged is not None:
            try:
                logged.result()
            except Exception as exc:
                # Without its batch in the log the step cannot be decided (recovery could not
                # replay it): its run is aborted on every stage now, so none commits it.
                self._metrics.inc("steps_aborted_total")
                ledger.aborted(training=True)
                group.abort(run_id)
                raise StepLogError(
                    f"job {group.job_id}: step {ledger.step + 1} was aborted on every stage and "
                    f"nothing was committed: its batch could not be written to the step log at "
                    f"{str(self._log.root)!r} ({type(exc).__name__}: {exc}); check the "
                    "coordinator's --state-dir (free space, permissions) and send the step again"
                ) from exc
        loss = float(sum(replies.losses))
        self.last_loss = (ledger.step + 1, loss)
        grad_scale = None
        clip = group.config.clip_grad_norm
        if clip is not None:
            total = math.sqrt(replies.grad_norm_sq)
            grad_scale = min(1.0, clip / (total + 1e-6))
        # Every stage holds the step prepared and its batch is in the step log: it is decided.
        # Its commit goes with the next run, or is flushed (see [Note: deferred commit]).
        ledger.decided(run_id, grad_scale)
        return loss

    def replay(self, batch: RunBatch) -> float:
        """Runs and decides a logged step again (recovery's replay), without logging it."""
        return self.train(batch, None)


class _LogWrite:
    """A step's write to the step log, made once, when first called; its error kept for
    ``result``."""

    def __init__(self, log: StepLog, step: int, batch: LoggedBatch) -> None:
        self._log, self._entry, self._batch = log, step, batch
        self._done = False
        self._error: Exception | None = None

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._log.write(self._entry, self._batch)
        except Exception as exc:
            self._error = exc

    def result(self) -> None:
        """Writes the entry if no run reached it; raises the write's error."""
        self()
        if self._error is not None:
            raise self._error
