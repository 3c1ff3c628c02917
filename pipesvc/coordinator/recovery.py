"""Recovery, migration, checkpoints and reconciling a job with its stages (see [Note: recovery]
in job.py).

``Recovery`` rebuilds a job's stages from durable state; it holds the job's stage group, its
state and its storage, and replays logged steps through the job's own step function. It runs
with the job's lock held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipesvc.coordinator import planner
from pipesvc.coordinator.job_state import JobState, PendingCommit
from pipesvc.coordinator.stage_calls import StageLostError, call_stage, health_of
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.coordinator.state_db import JobRecord, StateDB
from pipesvc.coordinator.step_log import StepLog, StepLogError
from pipesvc.core.cadence import CheckpointCadence, log_bound
from pipesvc.core.health import Health
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.plan import servers_of
from pipesvc.core.tensor_codec import named_frames, read_named_frames
from pipesvc.errors import (
    InternalError,
    InvalidArgumentError,
    PipesvcError,
    PlanError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from pipesvc.observe.metrics import Metrics
from pipesvc.storage.checkpoint import CheckpointStore, CheckpointWriter, read_layers, read_manifest
from pipesvc.v1 import common_pb2, stage_pb2

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

# [Note: background checkpoint] is in docs/architecture.md: a periodic checkpoint's state is read
# with the stages at the step, then written on the job's pool; it counts once durable.
CHECKPOINT_BUFFER_BYTES = 256 << 20
"""A periodic checkpoint whose state fits in this much coordinator memory is written in the
background; a larger one is written while it streams, one layer in memory at a time."""

ReplayStep = Callable[[RunBatch], object]
"""Runs and commits one logged step (its micro-batches), without logging it again."""


@dataclass
class JobStorage:
    """Where a job's durable state lives: the database row, checkpoints and the step log."""

    db: StateDB
    root: Path
    checkpoints: CheckpointStore = field(init=False)
    log: StepLog = field(init=False)

    def __post_init__(self) -> None:
        self.checkpoints = CheckpointStore(self.root / "checkpoints")
        self.log = StepLog(self.root / "steps")


class Recovery:
    """Rebuilding a job's stages: recovery from lost stages, migration off leaving ones,
    checkpoints, and reconciling after a coordinator restart."""

    def __init__(
        self,
        *,
        group: StageGroup,
        state: JobState,
        storage: JobStorage,
        metrics: Metrics,
        replay: ReplayStep,
        needs_reconcile: bool,
        pool: futures.ThreadPoolExecutor,
    ) -> None:
        self.group = group
        self.state = state
        self.storage = storage
        self._metrics = metrics
        self._replay = replay
        self._needs_reconcile = needs_reconcile
        self._checked_at = 0.0  # when ensure_ready last found every stage serving
        self._pool = pool
        self._writing: tuple[int, float, futures.Future[float]] | None = None
        """A checkpoint being written in the background: (step, seconds reading it, write)."""
        self._sized: tuple[int, int] | None = None
        """(checkpoint step, its bytes on disk), as ``_checkpoint_bytes`` last counted."""
        self.cadence = CheckpointCadence(
            group.config.checkpoint_every, start_step=max(state.checkpoint_step, 0)
        )
        """Which steps get a periodic checkpoint (see [Note: checkpoint cadence])."""

    # -- durable state -------------------------------------------------------------------------

    def record(self) -> JobRecord:
        """The job's database row."""
        group = self.group
        return self.state.to_record(
            job_id=group.job_id,
            config=group.config,
            layers=group.layers,
            plan=group.plan,
            epoch=group.epoch,
        )

    def persist(self) -> None:
        """Writes the job's database row, with the step results not written yet."""
        record = self.record()
        self.storage.db.put_job(record)
        self.state.saved(record.results)

    # -- deferred commits ----------------------------------------------------------------------

    def flush(self, *, due_checkpoint: bool = True) -> None:
        """Commits the pending decided step on every stage now (see [Note: deferred commit]
        in job.py), for a call that must see the committed weights; does nothing if none is
        pending. A step due a periodic checkpoint then gets it from the stages' live state
        (``due_checkpoint``; the checkpoint itself flushes without it).

        Raises:
            PipesvcError: the commit did not reach every stage; the step is the replay target
                (every later call first rebuilds the stages to it).
        """
        pending = self.state.pending
        if pending is None:
            return
        self.settle(pending, after_failed_run=False)
        if pending.snapshot and due_checkpoint:
            # No run carried it: the periodic checkpoint reads the stages instead.
            self.checkpoint(background=True)

    def settle(self, pending: PendingCommit, *, after_failed_run: bool) -> None:
        """Brings every stage to the decided ``pending`` step by Commit where it is still
        pending (``after_failed_run``: a run that carried it failed, and some stages may hold
        it applied); on failure, makes it the replay target.

        Raises:
            PipesvcError: some stage could not be brought to the step (replay target set).
        """
        group, state = self.group, self.state
        state.pending = None
        if pending.snapshot and after_failed_run:
            logger.warning(
                "job %s: the run that carried step %d's checkpoint failed; the next periodic "
                "checkpoint takes its place",
                group.job_id,
                pending.step,
            )
        try:
            group.commit(
                pending.request(group.job_id, group.epoch),
                step=pending.step,
                after_failed_run=after_failed_run,
            )
        except PipesvcError:
            # The step is decided: before any later call the stages are rebuilt to it (see
            # [Note: commit invariant]).
            state.replay_target = max(state.replay_target or 0, pending.step)
            raise
        if not after_failed_run:  # a failed training run may have dropped some stage's
            state.gradients_valid = True

    # -- readiness, recovery, migration --------------------------------------------------------

    def ensure_ready(self) -> None:
        """Finishes a pending reconcile; raises StageLostError if a stage is unreachable, and
        moves layers off stages that are leaving."""
        if self._needs_reconcile:
            self.reconcile()
        self.finish_checkpoint(wait=False)
        # Between back-to-back steps the watchdog of the last step has just seen every stage;
        # a fresh health round trip per step would only add latency.
        if time.monotonic() - self._checked_at < self.group.deadlines.health_interval_s:
            return
        statuses = self.group.health()
        lost = {a for a, s in statuses.items() if s == Health.UNREACHABLE}
        if lost:
            raise StageLostError(f"stages {', '.join(sorted(lost))} are unreachable", lost)
        leaving = {a for a, s in statuses.items() if s != Health.SERVING}
        if leaving:
            self.migrate(leaving)
        self._checked_at = time.monotonic()

    def lost_after(self, error: PipesvcError) -> set[str] | None:
        """The stages to replace after ``error``, or None if it is final (not a stage fault)."""
        if isinstance(error, StageLostError):
            return set(error.addresses)
        if isinstance(error, FINAL_ERRORS):
            return None
        statuses = self.group.health()
        lost = {a for a, status in statuses.items() if status == Health.UNREACHABLE}
        logger.warning(
            "job %s: %s; unreachable stages: %s",
            self.group.job_id,
            error,
            ", ".join(sorted(lost)) or "none",
        )
        return lost  # empty: a transient fault; rebuild the same plan

    def recover(self, lost: set[str], cause: PipesvcError | None) -> None:
        """Rebuilds the job without the ``lost`` stages (none: the same plan, a new epoch)."""
        started = time.monotonic()
        logger.warning(
            "job %s: recovering at step %d without %s (cause: %s)",
            self.group.job_id,
            self.state.step,
            ", ".join(sorted(lost)) or "losing a stage",
            cause,
        )
        self.rebuild(lost)
        self.state.recoveries += 1
        self._metrics.inc("recoveries_total")
        logger.warning(
            "job %s: recovered in %.2f s; plan now %s",
            self.group.job_id,
            time.monotonic() - started,
            self.group.describe(),
        )

    def migrate(self, leaving: set[str]) -> None:
        """Moves layers off stages that are shutting down (not a failure): checkpoint, replan."""
        logger.info(
            "job %s: moving layers off leaving stages %s",
            self.group.job_id,
            ", ".join(sorted(leaving)),
        )
        self.checkpoint()
        old = list(self.group.servers)
        self.rebuild(leaving)
        for stage in old:
            if stage.address in leaving:
                self.group.release(stage)

    def rebuild(self, without: set[str]) -> None:
        """New plan without ``without``; assign, restore the checkpoint, replay the log."""
        group, state = self.group, self.state
        old = list(group.plan)
        if without:
            candidates = planner.spare_candidates(group.registry, group.config, without)
            health = health_of(
                group.registry, [r.address for r in candidates], group.deadlines.health_s
            )
            group.plan = planner.replan(
                group.registry,
                group.config,
                group.layers,
                group.plan,
                without,
                group.job_id,
                candidates=candidates,
                health=health,
            )
        # Survivors the new plan leaves out (the rest of a dropped replica) go back to the pool.
        kept = {s.address for s in group.plan}
        left_out = [
            s for s in servers_of(old) if s.address not in without and s.address not in kept
        ]
        for stage in left_out:
            group.release(stage)
        group.registry.unclaim([s.address for s in left_out])
        group.epoch += 1
        # A recovery interrupted mid-replay keeps its target: the steps committed before it
        # (a decided step whose commit was pending among them; the new assignment drops it).
        target = state.step if state.replay_target is None else state.replay_target
        state.replay_target = target
        state.pending = None
        group.assign()
        self.restore()
        self.persist()
        m = group.config.step_microbatches
        for step in range(state.step + 1, target + 1):
            logged = self.storage.log.read(step)
            self._replay(RunBatch.split(logged.inputs, logged.targets, logged.side, m))
        state.replay_target = None
        self.persist()

    # -- checkpoints ---------------------------------------------------------------------------

    def restore(self) -> None:
        """Loads the newest checkpoint into freshly assigned stages (or keeps the seed's init)."""
        if self.state.checkpoint_step < 0:
            self.state.step = 0
            return
        directory = self.storage.checkpoints.path(self.state.checkpoint_step)
        manifest = read_manifest(directory)

        def frames() -> Iterator[common_pb2.TensorFrame]:
            for name, tensor in read_layers(directory, manifest, 0, manifest.num_layers):
                yield from named_frames(name, tensor)

        self.group.load_state(frames(), manifest.step)
        self.state.step = manifest.step

    def checkpoint(self, *, background: bool = False) -> None:
        """Streams every stage's weights and optimizer state to a new checkpoint on disk.

        ``background``: once the state is read (the stages must be at the step for that), the
        files are written and synced on the job's pool while later steps run, if the state
        fits in ``CHECKPOINT_BUFFER_BYTES``; the checkpoint counts (and the step log behind it
        is pruned) only once it is durable (see [Note: background checkpoint]).
        """
        self.flush(due_checkpoint=False)  # this is the checkpoint
        self.finish_checkpoint(wait=True)  # one at a time, in step order
        started = time.monotonic()
        group, step = self.group, self.state.step
        directory = self.storage.checkpoints.path(step)
        record = self.record()
        buffered: list[tuple[str, torch.Tensor]] = []
        size = 0
        writer: CheckpointWriter | None = None
        try:
            for name, tensor in read_named_frames(group.stream_state(common_pb2.CHECKPOINT)):
                if writer is None:
                    size += tensor.numel() * tensor.element_size()
                    if background and size <= CHECKPOINT_BUFFER_BYTES:
                        buffered.append((name, tensor))
                        continue
                    writer = CheckpointWriter(directory)
                    for entry in buffered:
                        writer.add(*entry)
                    buffered = []
                writer.add(name, tensor)
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        read_s = time.monotonic() - started
        if writer is None:
            future = self._pool.submit(self._write_checkpoint, directory, buffered, record, step)
            self._writing = (step, read_s, future)
            return
        self._finish_writer(writer, record, step)
        self._checkpointed(step, read_s, time.monotonic() - started - read_s, background=False)

    def log_over_bound(self) -> bool:
        """Whether a ``checkpoint_every=0`` job's step log has outgrown its bound, so that a
        checkpoint must prune it (see [Note: checkpoint cadence]); False while one is being
        written (it prunes the log once durable)."""
        if self.group.config.checkpoint_every != 0 or self._writing is not None:
            return False
        held = self.storage.log.size_bytes()
        bound = log_bound(self._checkpoint_bytes())
        if held <= bound:
            return False
        logger.warning(
            "job %s: checkpoint_every=0, and the step log since step %d holds %.1f MiB, more "
            "than its bound of %.1f MiB (a checkpoint's size, at least 64 MiB): taking a "
            "checkpoint at step %d to prune it",
            self.group.job_id,
            max(self.state.checkpoint_step, 0),
            held / 2**20,
            bound / 2**20,
            self.state.step,
        )
        return True

    def _checkpoint_bytes(self) -> int:
        """Bytes of the job's checkpoint on disk, or of its weights before it has one."""
        step = self.state.checkpoint_step
        if self._sized is None or self._sized[0] != step:
            directory = self.storage.checkpoints.path(step)
            if step >= 0 and directory.is_dir():
                size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
            else:
                size = sum(layer.parameter_bytes for layer in self.group.layers)
            self._sized = (step, size)
        return self._sized[1]

    def start_lineage(self, step: int | None) -> None:
        """The stages hold a state just loaded at ``step`` (None: the job's): it becomes the
        job's step and its checkpoint. When ``step`` is below the job's, the steps after it
        (their logged batches, newer checkpoints) belong to a superseded lineage: the new
        checkpoint becomes the one recovery restores before any of them is removed (see
        ``_checkpointed``), so the database always names a checkpoint on disk, and the step log
        drops its entries past ``step`` (the job's lock is held: no entry is being written).

        Raises:
            PipesvcError, OSError: the checkpoint failed; the load does not count, and the next
                call first rebuilds the stages to the job's state before it.
        """
        self.finish_checkpoint(wait=True)  # a background write must not land after this one
        state = self.state
        before = (state.step, state.checkpoint_step)
        step = state.step if step is None else step
        older = step < max(before)
        state.step = step
        try:
            self.checkpoint()
        except BaseException:
            # Not durable, so not loaded: the stages go back to what the database says.
            state.step, state.checkpoint_step = before
            state.replay_target = before[0]
            raise
        self.cadence.restart(step)
        if older:
            self.storage.log.drop_after(step)
            logger.info(
                "job %s: state loaded at step %d starts a new lineage; later checkpoints and "
                "logged steps are dropped",
                self.group.job_id,
                step,
            )

    def stream_snapshot(self, step: int) -> None:
        """After a run carried the commit of ``step`` with a snapshot: streams the stages'
        snapshots to a new checkpoint on the job's pool while later steps run (see [Note:
        snapshot checkpoint] in stage/engine.py); it counts once durable, like a background
        write (see [Note: background checkpoint])."""
        self.finish_checkpoint(wait=True)  # one at a time, in step order
        frames = self.group.stream_state(
            common_pb2.CHECKPOINT, snapshot_step=step, plan=list(self.group.primary)
        )  # drawn on the pool, from the plan of now
        future = self._pool.submit(
            self._write_checkpoint,
            self.storage.checkpoints.path(step),
            read_named_frames(frames),
            self.record(),
            step,
        )
        self._writing = (step, 0.0, future)

    def _write_checkpoint(
        self,
        directory: Path,
        entries: Iterable[tuple[str, torch.Tensor]],
        record: JobRecord,
        step: int,
    ) -> float:
        """Writes a checkpoint read earlier, or streaming in as ``entries`` are drawn (on the
        pool); returns the seconds it took."""
        started = time.monotonic()
        writer = CheckpointWriter(directory)
        try:
            for entry in entries:
                writer.add(*entry)
        except BaseException:
            writer.discard()
            raise
        self._finish_writer(writer, record, step)
        return time.monotonic() - started

    def _finish_writer(self, writer: CheckpointWriter, record: JobRecord, step: int) -> None:
        group = self.group
        try:
            # Coverage is by layer count (see [Note: checkpoint coverage]); that each layer
            # sent all its tensors is checked here, against the model, before the step log
            # behind this checkpoint is pruned.
            expected = {f"{layer.index}.{t.name}" for layer in group.layers for t in layer.tensors}
            missing = sorted(expected - writer.keys)
            if missing:
                raise InternalError(
                    f"the stages sent a checkpoint without {len(missing)} of the model's "
                    f"{len(expected)} tensors, e.g. {missing[:5]}"
                )
            writer.finish(
                job_id=group.job_id,
                step=step,
                spec=record.spec,
                num_layers=len(group.layers),
                plan=record.plan,
            )
        except BaseException:
            writer.discard()
            raise

    def finish_checkpoint(self, *, wait: bool) -> None:
        """Makes a checkpoint written in the background count once it is durable (``wait``:
        waits for it). A write that failed is dropped with a warning: the previous checkpoint
        and the step log behind it still cover every step."""
        if self._writing is None:
            return
        step, read_s, future = self._writing
        if not wait and not future.done():
            return
        self._writing = None
        try:
            write_s = future.result()
        except Exception as exc:  # any failure of the write only drops this checkpoint
            logger.warning(
                "job %s: writing the checkpoint of step %d failed; the one of step %d and the "
                "step log still cover it: %s",
                self.group.job_id,
                step,
                self.state.checkpoint_step,
                exc,
            )
            return
        self._checkpointed(step, read_s, write_s, background=True)

    def _checkpointed(self, step: int, read_s: float, write_s: float, *, background: bool) -> None:
        """A checkpoint of ``step`` is durable: it becomes the one recovery restores."""
        self.state.checkpoint_step = step
        self.cadence.checkpointed(step, read_s + write_s)
        self.persist()  # the pointer moves first; what it no longer needs goes after
        self.storage.log.prune(step)
        self.storage.checkpoints.prune(current=step)
        logger.info(
            "job %s: checkpoint at step %d in %.3f s (state read in %.3f s, written in %.3f s%s)",
            self.group.job_id,
            step,
            read_s if background else read_s + write_s,
            read_s,
            write_s,
            " in the background" if background else "",
        )

    # -- after a coordinator restart -----------------------------------------------------------

    def reconcile(self) -> None:
        """After a coordinator restart: adopt the stages as they are, or rebuild."""
        group, state, registry = self.group, self.state, self.group.registry
        deadline = time.monotonic() + group.deadlines.reconcile_s
        addresses = group.addresses
        known = set()
        while time.monotonic() < deadline:
            known = {r.address for r in registry.all() if r.alive}
            if set(addresses) <= known:
                break
            time.sleep(0.2)
        consistent = set(addresses) <= known
        infos: list[Any] = []
        if consistent:
            try:
                infos = group.call_all(
                    lambda stub: stub.Info, lambda s: stage_pb2.InfoRequest(), 5.0
                )
            except PipesvcError:
                consistent = False
        # The row's step is decided (see [Note: deferred commit] in job.py); a stage one step
        # behind holds it prepared, with its commit not yet flushed, or did not get there.
        consistent = consistent and all(
            i.job_id == group.job_id
            and i.plan_epoch == group.epoch
            and (i.step == state.step or (i.step == state.step - 1 and i.pending_run_id))
            for i in infos
        )
        behind = (
            [(s, i) for s, i in zip(group.servers, infos, strict=True) if i.step < state.step]
            if consistent
            else []
        )
        if behind and group.config.clip_grad_norm is not None:
            consistent = False  # its gradient scale was not saved: replay the step instead
        self._needs_reconcile = False
        state.run_id = max([state.run_id, *(i.last_run_id for i in infos)], default=state.run_id)
        # A coordinator killed while it sent a run leaves it on the stages it reached, where it
        # may still wait for a neighbour the run never reached (its whole receive deadline, with
        # the stage's run lock held, so every later call would wait behind it). The newest run
        # any stage started is not decided unless it is a behind stage's pending one (decided
        # runs are committed below), and stages that disagree on their newest run show that it
        # did not reach them all: it is aborted everywhere first, which wakes its waits. (A run
        # that reached every stage finished there: prepared, it is aborted below as before.)
        decided = {i.pending_run_id for i in infos if i.pending_run_id and i.step < state.step}
        started = {i.last_run_id for i in infos}
        newest = max(started, default=0)
        ours = all(i.job_id == group.job_id for i in infos)
        if len(started) > 1 and newest not in decided and ours:
            group.abort(newest)
        if consistent:
            ahead = max((i.pending_run_id for i in infos if i.step == state.step), default=0)
            if ahead:  # a run of the next step, never decided
                group.abort(ahead)
            try:
                for stage, info in behind:
                    request = stage_pb2.CommitRequest(
                        job_id=group.job_id, plan_epoch=group.epoch, run_id=info.pending_run_id
                    )
                    call_stage(
                        registry,
                        stage,
                        lambda stub: stub.Commit,
                        request,
                        group.deadlines.control_s,
                    )
            except PipesvcError as exc:
                logger.warning("job %s: committing the decided step failed: %s", group.job_id, exc)
                consistent = False
        if consistent:
            registry.claim(addresses, group.job_id)
            for stage in group.servers:
                registry.place(
                    stage.address,
                    rank=stage.rank,
                    start_layer=stage.start_layer,
                    end_layer=stage.end_layer,
                )
            logger.info(
                "job %s: resumed with its stages as they were (step %d)", group.job_id, state.step
            )
            return
        logger.warning("job %s: stages disagree with the saved state; rebuilding", group.job_id)
        registry.claim([a for a in addresses if a in known], group.job_id)
        self.rebuild(set(addresses) - known)
