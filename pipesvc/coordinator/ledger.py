"""The one writer of a job's step state: where training is, what is decided and not yet
committed, what the stages must be rebuilt to, and the row that records it (no gRPC here).

[Note: deferred commit] The commit of a decided step is not a round trip of its own: the
coordinator counts the step, writes the job's row (the durable record that it is decided; a
restarted coordinator commits or replays it, see ``reconcile.reconcile``), replies, and keeps
the commit as ``Ledger.pending``. The next run (training or inference) carries it in its
RunStep, and each stage applies it before the run starts (``StepRunner.run``). A call that must
see committed weights (state reads, checkpoints, load_state, GetJob, a graceful stop) flushes it
first with an explicit Commit (``Ledger.flush``, or ``Checkpointer.flush`` when the step is due
a checkpoint); maintenance flushes it once the job has been idle for ``IDLE_FLUSH_S``. A run
that carried it and failed is aborted and the commit settled where it is still pending
(``Ledger.settle``); when that cannot reach every stage, or a stage is lost first
(``Ledger.lost``), the step is the replay target, exactly as for a failed Commit. Measured on
a tiny model over 2 stages this took the ~1.4 ms Commit round off every step (see
bench/README.md).

[Note: step ledger] A job's step (``step``), its decided step whose commit the stages have not
applied (``pending``), the step a rebuild must reach (``replay_target``), whether the stages
hold the last committed step's gradients (``gradients_valid``), the newest run id (``run_id``)
and the checkpoint recovery restores (``checkpoint_step``) change only through the named
transitions of ``Ledger``; they are read-only properties everywhere else, and
``tests/unit/test_ledger.py`` checks that no other module assigns them. Each transition checks
the order it is legal in and raises ``TransitionError`` (an ``AssertionError``: a coordinator
bug, never a caller's, and never taken for a stage fault by recovery) with nothing changed when
it is called out of order. The job's lock is held for every transition (the job's parts run
under it); the background checkpoint writer never calls one (its result counts on the job's
thread, see ``Checkpointer.finish``).

Who calls what, and what holds if the coordinator dies right after it (the row is the durable
record, see [Note: decision record] in docs/architecture.md):

- ``begin_run`` (the step runner, before each run phase): run ids only grow, so a stage refuses
  anything of an older run. A crash: the row's ``run_id`` may be behind a run the stages saw;
  reconciling adopts the highest any stage reports (``adopt_runs``).
- ``decided`` (the step runner, once every stage holds the run prepared and its batch is in the
  step log): the step counts, and its commit is ``pending``. A crash before the row is
  written: the stages are one step past the row, holding the run prepared; a restarted
  coordinator aborts it there (the client's retry runs it again). After: the row counts it,
  and reconciling commits it where it is still prepared.
- ``snapshot_due`` (the checkpointer, when the cadence picks the step): the run that carries
  the commit asks every stage for a snapshot. Nothing durable changes.
- ``carried`` (the step runner, after a run that carried the commit succeeded): every stage
  applied it and holds its gradients. A crash: nothing to redo.
- ``aborted`` (the step runner, after a run is aborted): a training run's abort leaves no
  gradients to report until the next commit.
- ``lost`` (the step runner, when a run that carried the commit lost a stage) and a failed
  ``settle``: the decided step becomes the replay target, so every later call first rebuilds
  the stages to it. A crash: the row counts the step (``committed_step``), its batch is in the
  log, and a restarted coordinator reconciles or rebuilds to it.
- ``settle`` and ``flush`` (the step runner after a run that carried the commit failed; every
  call that must see committed weights): send the explicit Commit, through the ``Committer``
  (the one place that sends it). ``pending`` is cleared before the commit goes out, so a
  failure leaves the replay target, never a half-pending step.
- ``rebuilding``, ``restored``, ``replayed`` (recovery, in that order): the rebuild's target
  is kept (a recovery interrupted mid-replay resumes towards it) and the pending commit is
  dropped (reassigned stages no longer hold its run); after the restore ``step`` is the
  checkpoint's and climbs through the replayed steps (each ``decided``); ``replayed`` clears
  the target once ``step`` reached it. A crash at any point: the row's step is the target
  (``committed_step``), so the restarted coordinator rebuilds to the same step.
- ``checkpointed`` (the checkpointer, once a checkpoint is durable): it becomes the one
  recovery restores; the row is written before anything behind it is pruned.
- ``loaded`` and ``unloaded`` (the checkpointer's ``start_lineage``): a state loaded onto the
  stages becomes the job's step; if its checkpoint cannot be made durable the load is undone
  and the job's old step becomes the replay target.

[Note: the row's counters] The row holds the job's shape (spec, plan, model description,
epoch) beside its counters, and a step changes only the counters (and adds its result). So
``persist`` writes the whole row once, and then only the counters (``StateDB.put_counters``)
for as long as the shape holds the very objects that row was made from: the config and the
plan's entries are frozen, and a plan, description or config that changes is a new object
(re-planning, recovery, a rebalance), so the next row is written whole again. A shape that
changed and then changed back is written whole too (it is not the same objects). What the
identity check cannot see is a change inside one of those objects (a layer description's
protobuf, a mapping inside the config): nothing changes them in place, and nothing may. The
model description of a large model is tens of KiB, which every step used to serialize and
write; on the tiny model the step's row went from 68 to 36 us (``bench/README.md``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

from pipesvc.coordinator.database import JobRecord, StateDB
from pipesvc.coordinator.job_counters import JobState, PendingCommit
from pipesvc.core.config import JobConfig, config_to_dict
from pipesvc.core.plan import PipelineStage, plan_to_dicts
from pipesvc.errors import PipesvcError
from pipesvc.v1 import stage_pb2


class TransitionError(AssertionError):
    """A ledger transition called out of order: a bug in the coordinator; nothing changed."""


class Committer(Protocol):
    """What sends a pending commit to every stage (``commit.GroupCommitter``; a fake in
    tests)."""

    def commit(self, pending: PendingCommit, *, after_failed_run: bool) -> None:
        """Brings every stage to ``pending.step`` (see [Note: commit invariant]).

        Raises:
            PipesvcError: some stage could not be brought to the step.
        """


class JobShape(Protocol):
    """The parts of a job's row that are not its step state (``StageGroup`` has them)."""

    job_id: str
    config: JobConfig
    layers: list[stage_pb2.LayerDescription]
    plan: list[PipelineStage]
    epoch: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Described:
    """The parts of a job's row that come from its shape, with the objects they were made
    from (see [Note: the row's counters])."""

    config: JobConfig
    plan: tuple[PipelineStage, ...]
    layers: tuple[stage_pb2.LayerDescription, ...]
    epoch: int
    spec: dict[str, Any]
    plan_dicts: list[dict[str, Any]]
    layers_bytes: bytes

    @classmethod
    def of(cls, shape: JobShape) -> _Described:
        return cls(
            config=shape.config,
            plan=tuple(shape.plan),
            layers=tuple(shape.layers),
            epoch=shape.epoch,
            spec=config_to_dict(shape.config),
            plan_dicts=plan_to_dicts(list(shape.plan)),
            layers_bytes=stage_pb2.DescribeResponse(layers=shape.layers).SerializeToString(),
        )

    def describes(self, shape: JobShape) -> bool:
        """Whether ``shape`` holds the very objects these parts were made from (the config
        and plan entries are frozen; a changed plan or description is a new list)."""
        return (
            shape.config is self.config
            and shape.epoch == self.epoch
            and _same_items(shape.plan, self.plan)
            and _same_items(shape.layers, self.layers)
        )


def _same_items(items: Sequence[object], made_from: tuple[object, ...]) -> bool:
    if len(items) != len(made_from):
        return False
    return all(a is b for a, b in zip(items, made_from, strict=True))


@dataclasses.dataclass(frozen=True, slots=True)
class Loaded:
    """What ``Ledger.loaded`` replaced, so that ``unloaded`` puts it back."""

    step: int
    checkpoint_step: int


class Ledger:
    """A job's step state and its database row, changed only by named transitions (see [Note:
    step ledger])."""

    def __init__(
        self,
        *,
        shape: JobShape,
        state: JobState,
        db: StateDB,
        committer: Committer,
        step: int = 0,
        run_id: int = 0,
        checkpoint_step: int = -1,
    ) -> None:
        self._shape = shape
        self.state = state
        """The job's other counters and its remembered results (written with the row)."""
        self._db = db
        self._committer = committer
        self._step = step
        self._pending: PendingCommit | None = None
        self._run_id = run_id
        self._checkpoint_step = checkpoint_step
        self._replay_target: int | None = None
        self._run_ahead: tuple[int, int] | None = None
        self._gradients_valid = True
        self._decided_at = 0.0
        self._described: _Described | None = None
        """The row's parts from the job's shape, as last made."""
        self._stored: _Described | None = None
        """Those the database row holds, once this ledger wrote it whole."""

    # -- what it holds (read-only) ---------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps committed on the stages as they are now (behind ``replay_target`` mid-replay),
        counting a decided step whose commit is ``pending``."""
        return self._step

    @property
    def pending(self) -> PendingCommit | None:
        """The decided step every stage holds prepared, not yet committed (it is step
        ``step``; see [Note: deferred commit] in ledger.py)."""
        return self._pending

    @property
    def run_id(self) -> int:
        """Highest run id used."""
        return self._run_id

    @property
    def run_ahead(self) -> tuple[int, int] | None:
        """(a run sent ahead, the run it follows), while one is out (see [Note: steps ahead]
        in step_runner.py)."""
        return self._run_ahead

    @property
    def checkpoint_step(self) -> int:
        """Step of the checkpoint recovery restores, or -1 when the initial weights are the
        seed's."""
        return self._checkpoint_step

    @property
    def replay_target(self) -> int | None:
        """While set, the stages must be rebuilt to this step before any other call (a commit
        that did not reach every stage, or a recovery that gave up mid-replay)."""
        return self._replay_target

    @property
    def gradients_valid(self) -> bool:
        """False after an aborted training run: stages that began it zeroed the last committed
        step's gradients in place, others kept them; none are reported until a commit."""
        return self._gradients_valid

    @property
    def decided_at(self) -> float:
        """When (``time.monotonic``) the newest step was decided (for the idle flush)."""
        return self._decided_at

    @property
    def committed_step(self) -> int:
        """Committed steps: mid-replay, the replay's target, not where replay is."""
        return max(self._step, self._replay_target or 0)

    # -- the row ---------------------------------------------------------------------------------

    def record(self) -> JobRecord:
        """The job's database row (its spec and plan are shared with later rows while the
        job's shape stays: not to be changed)."""
        return self._record(self._describe())

    def persist(self) -> None:
        """Writes the job's database row, with the step results not written yet: only its
        counters while the row already holds the job's shape (see [Note: the row's
        counters])."""
        described = self._describe()
        record = self._record(described)
        if described is not self._stored or not self._db.put_counters(record):
            self._db.put_job(record)
            self._stored = described
        self.state.saved(record.results)

    def _describe(self) -> _Described:
        """The row's parts taken from the job's shape, made again only when it changed."""
        described = self._described
        if described is None or not described.describes(self._shape):
            described = self._described = _Described.of(self._shape)
        return described

    def _record(self, described: _Described) -> JobRecord:
        state = self.state
        return JobRecord(
            job_id=self._shape.job_id,
            spec=described.spec,
            plan=described.plan_dicts,
            layers=described.layers_bytes,
            epoch=described.epoch,
            step=self.committed_step,
            run_id=self._run_id,
            checkpoint_step=self._checkpoint_step,
            closed=state.closed,
            results=list(state.unsaved),
        )

    # -- runs and steps --------------------------------------------------------------------------

    def begin_run(self) -> int:
        """A new run id for the run phase about to start (ids only grow)."""
        self._run_id += 1
        return self._run_id

    def begin_ahead(self, after: int) -> int:
        """A new run id for the next step's run, sent while run ``after`` (the newest) is out
        and before its step is decided (see [Note: steps ahead] in step_runner.py).

        Raises:
            TransitionError: a run is out ahead already, or ``after`` is not the newest run.
        """
        _require(
            self._run_ahead is None, f"a run sent ahead of run {after} with {self._run_ahead} out"
        )
        _require(after == self._run_id, f"a run sent ahead of run {after}; newest {self._run_id}")
        self._run_id += 1
        self._run_ahead = (self._run_id, after)
        return self._run_id

    def ahead_taken(self, run_id: int) -> None:
        """The run sent ahead is now the step's run (it carries the pending commit).

        Raises:
            TransitionError: ``run_id`` is not the run out ahead, or the run it follows was not
                decided.
        """
        ahead = self._run_ahead
        _require(ahead is not None and ahead[0] == run_id, f"run {run_id} taken; ahead: {ahead}")
        assert ahead is not None
        pending = self._pending
        _require(
            pending is not None and pending.run_id == ahead[1],
            f"run {run_id} taken while run {ahead[1]} is not the pending commit ({pending})",
        )
        self._run_ahead = None

    def ahead_dropped(self) -> None:
        """The run sent ahead was aborted (or its stages reassigned) before it was taken."""
        self._run_ahead = None

    def diverged(self) -> None:
        """A run that failed had a run sent ahead of it, which applied the failed run's step
        on some stage (see [Note: steps ahead] in step_runner.py): that step is not decided, so
        every stage is rebuilt to the decided step (the replay target) before any later call.
        """
        self._run_ahead = None
        self._pending = None
        self._replay_target = max(self._replay_target or 0, self._step)

    def adopt_runs(self, seen: Sequence[int]) -> None:
        """After a coordinator restart: the stages saw runs up to ``max(seen)``; later runs
        get higher ids."""
        self._run_id = max([self._run_id, *seen])

    def decided(self, run_id: int, grad_scale: float | None) -> PendingCommit:
        """Every stage holds run ``run_id`` prepared and its batch is in the step log: the
        next step is decided and counts; its commit is pending (see [Note: deferred commit]).

        Raises:
            TransitionError: a commit is still pending, ``run_id`` is not the newest run, or
                the step would pass the replay target.
        """
        _require(self._pending is None, f"step {self._step + 1} decided with {self._pending}")
        ahead = self._run_ahead
        _require(
            run_id == self._run_id or (ahead is not None and run_id == ahead[1]),
            f"run {run_id} decided; the newest is {self._run_id} (ahead: {ahead})",
        )
        target = self._replay_target
        _require(
            target is None or self._step < target,
            f"step {self._step + 1} decided past the replay target {target}",
        )
        self._step += 1
        self._pending = PendingCommit(step=self._step, run_id=run_id, grad_scale=grad_scale)
        self._decided_at = time.monotonic()
        return self._pending

    def snapshot_due(self) -> None:
        """The pending step is due a periodic checkpoint: the run that carries its commit asks
        every stage for a snapshot (see [Note: snapshot checkpoint] in stage/compute/engine.py).

        Raises:
            TransitionError: no commit is pending.
        """
        pending = self._pending
        _require(pending is not None, "a snapshot asked for with no commit pending")
        assert pending is not None
        self._pending = dataclasses.replace(pending, snapshot=True)

    def carried(self, pending: PendingCommit) -> None:
        """A run that carried ``pending`` succeeded: every stage applied it, and holds its
        gradients.

        Raises:
            TransitionError: ``pending`` is not the pending commit.
        """
        self._require_pending(pending, "carried")
        self._pending = None
        self._gradients_valid = True

    def aborted(self, *, training: bool) -> None:
        """A run was aborted on every stage; a training run's abort leaves the stages without
        the last committed step's gradients (some zeroed them) until the next commit. A commit
        it carried is ``lost`` or ``settle``d next."""
        if training:
            self._gradients_valid = False

    def lost(self, pending: PendingCommit) -> None:
        """A run that carried ``pending`` lost a stage: recovery rebuilds every stage to the
        decided step (it becomes the replay target).

        Raises:
            TransitionError: ``pending`` is not the pending commit.
        """
        self._require_pending(pending, "lost")
        self._pending = None
        self._replay_target = max(self._replay_target or 0, pending.step)

    def settle(self, pending: PendingCommit, *, after_failed_run: bool) -> None:
        """Brings every stage to the decided ``pending`` step by an explicit Commit where it is
        still pending (``after_failed_run``: a run that carried it failed, and some stages may
        hold it applied); on failure, makes it the replay target.

        Raises:
            TransitionError: ``pending`` is not the pending commit.
            PipesvcError: some stage could not be brought to the step (replay target set).
        """
        self._require_pending(pending, "settled")
        self._pending = None
        try:
            self._committer.commit(pending, after_failed_run=after_failed_run)
        except PipesvcError:
            # The step is decided: before any later call the stages are rebuilt to it (see
            # [Note: commit invariant] in commit.py).
            self._replay_target = max(self._replay_target or 0, pending.step)
            raise
        if not after_failed_run:  # a failed training run may have dropped some stage's
            self._gradients_valid = True

    def flush(self) -> PendingCommit | None:
        """Commits the pending decided step on every stage now, for a call that must see the
        committed weights; returns it (None: none was pending).

        Raises:
            PipesvcError: the commit did not reach every stage (the step is the replay target).
        """
        pending = self._pending
        if pending is not None:
            self.settle(pending, after_failed_run=False)
        return pending

    # -- rebuilding ------------------------------------------------------------------------------

    def rebuilding(self) -> int:
        """A rebuild starts (new assignment, restore, replay): returns the step it must reach
        (kept from an interrupted one), which stays the replay target until ``replayed``; the
        pending commit is dropped (reassigned stages no longer hold its run)."""
        target = self._step if self._replay_target is None else self._replay_target
        self._replay_target = target
        self._pending = None
        self._run_ahead = None
        return target

    def restored(self, step: int) -> None:
        """Mid-rebuild, the stages hold the state of ``step`` (the checkpoint's, or 0 for the
        seed's weights).

        Raises:
            TransitionError: no rebuild is under way, or ``step`` is past its target.
        """
        target = self._replay_target
        _require(target is not None, f"step {step} restored outside a rebuild")
        assert target is not None
        _require(self._pending is None, f"step {step} restored with {self._pending}")
        _require(0 <= step <= target, f"step {step} restored for a rebuild to step {target}")
        self._step = step

    def replayed(self) -> None:
        """The rebuild reached its target: the stages are where the job's row says.

        Raises:
            TransitionError: no rebuild is under way, or it has not reached its target.
        """
        target = self._replay_target
        _require(
            target is not None and self._step == target,
            f"replay ended at step {self._step}; its target is {target}",
        )
        self._replay_target = None

    # -- checkpoints -----------------------------------------------------------------------------

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` is durable: recovery restores it from now on.

        Raises:
            TransitionError: ``step`` is past every committed step.
        """
        _require(
            0 <= step <= self.committed_step,
            f"a checkpoint of step {step} with {self.committed_step} steps committed",
        )
        self._checkpoint_step = step

    def loaded(self, step: int) -> Loaded:
        """The stages hold a state just loaded at ``step``, which becomes the job's step (its
        checkpoint is written next); returns what to put back if that fails.

        Raises:
            TransitionError: a commit is pending, or a rebuild is unfinished.
        """
        _require(self._pending is None, f"a state loaded with {self._pending}")
        _require(self._replay_target is None, "a state loaded during a rebuild")
        before = Loaded(step=self._step, checkpoint_step=self._checkpoint_step)
        self._step = step
        return before

    def unloaded(self, before: Loaded) -> None:
        """The loaded state's checkpoint failed: the load does not count; the stages are
        rebuilt to the step ``before`` had before any later call."""
        self._step, self._checkpoint_step = before.step, before.checkpoint_step
        self._replay_target = before.step

    # -- checks ----------------------------------------------------------------------------------

    def _require_pending(self, pending: PendingCommit, what: str) -> None:
        _require(
            self._pending is not None and self._pending == pending,
            f"the commit of step {pending.step} (run {pending.run_id}) {what}; pending: "
            f"{self._pending}",
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise TransitionError(message)
