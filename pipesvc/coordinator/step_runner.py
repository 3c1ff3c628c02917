"""One run phase on every stage, carrying the pending commit, and one training step up to its
decision (see [Note: commit] and [Note: deferred commit] in ledger.py).

``StepRunner`` is what a call runs and what recovery replays: both go through the same code, so
a replayed step is decided, carried and settled exactly as the step it replays. Every change
of the step state goes through the job's ``Ledger`` (see [Note: step ledger]). It runs with the
job's lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pipesvc.coordinator.checkpointer import Checkpointer
from pipesvc.coordinator.job_counters import PendingCommit
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.replicas import RunReplies
from pipesvc.coordinator.stage_calls import Meanwhile, StageLostError
from pipesvc.coordinator.stage_group import SentRun, StageGroup
from pipesvc.coordinator.step_log import LoggedBatch, StepLog, StepLogDamagedError, StepLogError
from pipesvc.coordinator.train_stream import Upcoming
from pipesvc.core.clipping import clip_scale
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
    StepLogDamagedError,
)
"""Errors that are the caller's (or the plan's, or the coordinator's disk's) and that a
recovery cannot fix."""


@dataclass
class _SentAhead:
    """A training run sent before the step it follows was decided."""

    batch: RunBatch
    run_id: int
    after: int
    """The run it follows, whose commit it carries."""
    sent: SentRun


class StepRunner:
    """Runs a job's run phases and training steps on its stages as they are now.

    [Note: steps ahead] In a stream of training steps (``Job.train``), step N+1's run goes to
    the stages while step N's runs, carrying N's commit before N is decided. Each stage starts
    it the moment its own part of run N has ended (see [Note: run ahead] in
    stage/compute/engine.py): it applies N's optimizer step and goes on, so no stage waits
    for the coordinator between two steps. The coordinator meanwhile decides N exactly as
    before (every stage's reply, the step log, the row) and then takes the run sent ahead as
    step N+1's (``ahead_taken``), writes N+1's log entry and sends N+2 ahead. A step's log
    entry is written before the run that carries its commit is sent, so a stage never applies
    a step whose batch is not in the log. N+1 goes the moment both hold: its request prepared
    and N's entry written. One that arrives while N's run is out (the first of a stream, or a
    client that loads each batch as it goes) wakes the wait for N's replies and goes from
    there (``_SendAhead``); nothing waits for it.

    What it changes is who may run ahead of the decision: a stage whose part of run N ended
    applies N before the coordinator knows that every other stage's part ended too. If run N
    then fails, the run sent ahead is aborted everywhere and the stages are asked where they
    are: when none applied N, the failure is handled as any failed run; when some did, the
    job is rebuilt to the decided step (``Ledger.diverged``, as recovery does after a lost
    stage), so no call ever sees N. A coordinator that dies with a stage past its row is
    rebuilt by reconciling. In a job that clips gradients the run sent ahead carries no scale:
    the stages derive it from the global norm they sum along the links, exactly as the
    coordinator does from their replies (see [Note: norm along the links] in
    pipesvc.core.clipping). A run is sent ahead only when nothing else needs the step's
    commit first: the step is not due a checkpoint snapshot, every replica takes part, no
    other call waits for the job, and a job that clips has one replica. A run sent ahead that
    is not taken (the stream ended, another call came) is aborted and N's commit completed
    where it is still pending (``drop_ahead``).
    """

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
        self._sent_ahead: _SentAhead | None = None

    def run(
        self,
        mode: stage_pb2.RunMode.ValueType,
        batch: RunBatch,
        during: Callable[[], None] | None = None,
        meanwhile: Meanwhile | None = None,
    ) -> tuple[int, RunReplies]:
        """One run phase on every stage under a new run id, carrying the pending commit (see
        [Note: deferred commit] in ledger.py); aborted everywhere if it fails. ``during``: as
        for ``StageGroup.run_step`` (called once per attempt; it must not raise).
        ``meanwhile``: done while the first attempt's replies are awaited (``gather``).

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
            ran = self._run_once(mode, batch, carried, during, meanwhile)
        except PipesvcError as exc:
            if carried is None or ledger.pending != carried:
                raise  # nothing carried, or the stages are to be rebuilt (``diverged``)
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
        return self._run_once(mode, batch, None, during, None)

    def _run_once(
        self,
        mode: stage_pb2.RunMode.ValueType,
        batch: RunBatch,
        carried: PendingCommit | None,
        during: Callable[[], None] | None,
        meanwhile: Meanwhile | None,
    ) -> tuple[int, RunReplies]:
        ledger, group = self._ledger, self._group
        training = mode == stage_pb2.TRAIN
        taken = self._take_ahead(batch, carried)
        if taken is not None:
            run_id, sent = taken.run_id, taken.sent
        else:
            run_id = ledger.begin_run()
            what = (
                f"run {run_id} (step {ledger.step + 1})" if training else f"inference run {run_id}"
            )
            commit = carried.carried() if carried is not None else None
            self._checkpoints.before_run(carried is not None and carried.snapshot)
            sent = group.send_run(run_id, mode, batch, what=what, commit=commit)
        try:
            if during is not None:
                during()
            replies = sent.replies(meanwhile)
        except PipesvcError as exc:
            self._metrics.inc("steps_aborted_total")
            ledger.aborted(training=training)
            lost = exc.addresses if isinstance(exc, StageLostError) else set()
            group.abort(run_id, lost=lost)
            self._ahead_of_failed(lost)
            raise
        if carried is not None:
            ledger.carried(carried)
        return run_id, replies

    @property
    def sent_ahead(self) -> RunBatch | None:
        """The batch whose run is out ahead, if any."""
        return None if self._sent_ahead is None else self._sent_ahead.batch

    def _take_ahead(self, batch: RunBatch, carried: PendingCommit | None) -> _SentAhead | None:
        """The run sent ahead for ``batch``, taken as its step's run; None if there is none
        (one sent for another batch, or before a rebuild, is dropped)."""
        ahead = self._sent_ahead
        if ahead is None:
            return None
        if (
            ahead.batch is batch
            and carried is not None
            and carried.run_id == ahead.after
            and ahead.sent.epoch == self._group.epoch
        ):
            self._sent_ahead = None
            self._ledger.ahead_taken(ahead.run_id)
            return ahead
        self.drop_ahead()
        return None

    def send_ahead(self, next_batch: RunBatch, after: int) -> None:
        """Sends ``next_batch``'s training run ahead of run ``after`` (out now, its step not
        decided), carrying ``after``'s commit (see [Note: steps ahead])."""
        ledger, group = self._ledger, self._group
        run_id = ledger.begin_ahead(after)
        # A job that clips sends no scale: the stages take it from the norm they sum along
        # the links (see [Note: norm along the links] in pipesvc.core.clipping).
        clips = group.config.clip_grad_norm is not None
        commit = stage_pb2.CarriedCommit(run_id=after, scale_from_links=clips)
        what = f"run {run_id} (step {ledger.step + 2}, sent ahead)"
        # If this raises, some stages may hold the run: the ledger still names it, so the
        # failure of the run it follows aborts it there (``_ahead_of_failed``).
        sent = group.send_run(run_id, stage_pb2.TRAIN, next_batch, what=what, commit=commit)
        self._sent_ahead = _SentAhead(batch=next_batch, run_id=run_id, after=after, sent=sent)
        self._metrics.inc("runs_sent_ahead_total")

    def may_send_ahead(self, next_batch: RunBatch) -> bool:
        """Whether the next step may go ahead of the running one's decision (see [Note:
        steps ahead]): no snapshot due, every replica taking part, and in a job that clips,
        one replica (see [Note: norm along the links] in pipesvc.core.clipping)."""
        group = self._group
        config = group.config
        return (
            self._sent_ahead is None
            and (config.clip_grad_norm is None or config.data_parallel == 1)
            and not self._checkpoints.would_snapshot(self._ledger.step + 1)
            and all(group.shares(stage_pb2.TRAIN, len(next_batch.inputs)))
        )

    def _pop_ahead(self) -> _SentAhead | None:
        """The run sent ahead, no longer out as far as the ledger is concerned."""
        ahead, self._sent_ahead = self._sent_ahead, None
        self._ledger.ahead_dropped()
        return ahead

    def _ahead_of_failed(self, lost: set[str]) -> None:
        """After the abort of a run that had the next step's run sent ahead of it (the
        ledger's ``run_ahead``, even if its sending failed part way): aborts that one too and,
        if some stage applied the failed run's step on its way, has the stages rebuilt to the
        decided step (see [Note: steps ahead])."""
        ledger, group = self._ledger, self._group
        out = ledger.run_ahead
        self._pop_ahead()
        if out is None:
            return
        run_id, after = out
        group.abort(run_id, lost=lost)
        if lost or not group.no_stage_past(ledger.step):
            logger.warning(
                "job %s: run %d failed after run %d was sent ahead of it; the stages are "
                "rebuilt to step %d",
                group.job_id,
                after,
                run_id,
                ledger.step,
            )
            ledger.diverged()

    def drop_ahead(self) -> None:
        """Aborts the run sent ahead, if any, on every stage, and completes the commit it
        carried where it is still pending (see [Note: steps ahead]).

        Raises:
            PipesvcError: the commit did not reach every stage (the step is the replay
                target).
        """
        ahead = self._pop_ahead()
        if ahead is None:
            return
        ledger, group = self._ledger, self._group
        if ahead.sent.epoch != group.epoch:
            return  # the stages were reassigned: the run went with them
        group.abort(ahead.run_id)
        ledger.aborted(training=True)
        pending = ledger.pending
        if pending is not None and pending.run_id == ahead.after:
            ledger.settle(pending, after_failed_run=True)

    def train(
        self, batch: RunBatch, log: LoggedBatch | None, ahead: Upcoming[RunBatch] | None = None
    ) -> float:
        """Runs the next training step and decides it (its commit pending, see [Note:
        deferred commit]); returns its loss. ``log``: its batch for the step log, written while
        the stages compute (None: a replayed step, logged already). ``ahead``: the next step,
        sent ahead if it may be once this one's log entry is written and it is ready, before
        this one is decided (see [Note: steps ahead]).

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
        # Asked for in the first attempt only: not for the run again without its commit.
        meanwhile = None
        if ahead is not None and logged is not None:
            meanwhile = _SendAhead(self, ledger, ahead, logged)
        run_id, replies = self.run(stage_pb2.TRAIN, batch, logged, meanwhile)
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
            grad_scale = clip_scale(replies.grad_norm_sq, clip)
        # Every stage holds the step prepared and its batch is in the step log: it is decided.
        # Its commit goes with the next run, or is flushed (see [Note: deferred commit]).
        ledger.decided(run_id, grad_scale)
        return loss

    def replay(self, batch: RunBatch) -> float:
        """Runs and decides a logged step again (recovery's replay), without logging it."""
        return self.train(batch, None)


class _SendAhead:
    """Sends the stream's next step's run ahead of the running one as soon as it is ready,
    while the running one's replies are awaited (``gather``'s ``meanwhile``): a step that
    arrives while the run is out still goes ahead of its decision (see [Note: steps
    ahead]). It waits for nothing: without a next step, the running one is decided as
    usual."""

    def __init__(
        self, runner: StepRunner, ledger: Ledger, ahead: Upcoming[RunBatch], logged: _LogWrite
    ) -> None:
        self._runner, self._ledger, self._ahead, self._logged = runner, ledger, ahead, logged

    def watch(self, wake: Callable[[], None] | None) -> None:
        self._ahead.watch(wake)

    def __call__(self) -> bool:
        self._logged()  # written once, before any run carries this step's commit
        if self._logged.failed:  # only a step whose batch is in the log may be carried
            return True
        next_batch = self._ahead()
        if next_batch is None:
            return False
        runner = self._runner
        if runner.may_send_ahead(next_batch):
            runner.send_ahead(next_batch, self._ledger.run_id)
        return True


class _LogWrite:
    """A step's write to the step log, made once, when first called; its error kept for
    ``result``."""

    def __init__(self, log: StepLog, step: int, batch: LoggedBatch) -> None:
        self._log, self._entry, self._batch = log, step, batch
        self._done = False
        self._error: Exception | None = None

    @property
    def failed(self) -> bool:
        """Whether the write was made and failed."""
        return self._error is not None

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
