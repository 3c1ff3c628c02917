"""Rebuilding a job's stages from durable state: a new plan and assignment, the checkpoint
restored, the logged steps replayed (see [Note: recovery] in job.py); and what leads to a
rebuild: a lost stage, a leaving one, a coordinator restart (reconciling).

``Recovery`` takes what it needs explicitly: the stage group (plan, epoch, assignment), the
``Ledger`` (the step state; every change of it is a ledger transition, see [Note: step
ledger]), the ``Checkpointer`` (a migration's checkpoint, a background write to finish), the
``StepRunner`` that replays a logged step exactly as it ran, and the storage it restores and
replays from. It runs with the job's lock held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from pipesvc.coordinator import planner
from pipesvc.coordinator.checkpointer import Checkpointer
from pipesvc.coordinator.job_storage import JobStorage
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.stage_calls import StageLostError, call_stage, health_of
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.coordinator.step_runner import FINAL_ERRORS, StepRunner
from pipesvc.core.health import Health
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.plan import servers_of
from pipesvc.core.tensor_codec import named_frames
from pipesvc.errors import PipesvcError
from pipesvc.observe.metrics import Metrics
from pipesvc.storage.checkpoint import read_layers, read_manifest
from pipesvc.v1 import common_pb2, stage_pb2

logger = logging.getLogger(__name__)

__all__ = ["FINAL_ERRORS", "JobStorage", "Recovery"]


class Recovery:
    """Rebuilding a job's stages: recovery from lost stages, migration off leaving ones, and
    reconciling after a coordinator restart."""

    def __init__(
        self,
        *,
        group: StageGroup,
        ledger: Ledger,
        checkpoints: Checkpointer,
        runner: StepRunner,
        storage: JobStorage,
        metrics: Metrics,
        needs_reconcile: bool,
    ) -> None:
        self.group = group
        self._ledger = ledger
        self._checkpoints = checkpoints
        self._runner = runner
        self._storage = storage
        self._metrics = metrics
        self._needs_reconcile = needs_reconcile
        self._checked_at = 0.0  # when ensure_ready last found every stage serving

    # -- readiness, recovery, migration --------------------------------------------------------

    def ensure_ready(self) -> None:
        """Finishes a pending reconcile; raises StageLostError if a stage is unreachable, and
        moves layers off stages that are leaving."""
        if self._needs_reconcile:
            self.reconcile()
        self._checkpoints.finish(wait=False)
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
            self._ledger.step,
            ", ".join(sorted(lost)) or "losing a stage",
            cause,
        )
        self.rebuild(lost)
        self._ledger.state.recoveries += 1
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
        self._checkpoints.checkpoint()
        old = list(self.group.servers)
        self.rebuild(leaving)
        for stage in old:
            if stage.address in leaving:
                self.group.release(stage)

    def rebuild(self, without: set[str]) -> None:
        """New plan without ``without``; assign, restore the checkpoint, replay the log."""
        group, ledger = self.group, self._ledger
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
        target = ledger.rebuilding()
        group.assign()
        self.restore()
        ledger.persist()
        self.replay(target)
        ledger.replayed()
        ledger.persist()

    # -- restore and replay ----------------------------------------------------------------------

    def restore(self) -> None:
        """Loads the newest checkpoint into freshly assigned stages (or keeps the seed's init)."""
        ledger = self._ledger
        if ledger.checkpoint_step < 0:
            ledger.restored(0)
            return
        directory = self._storage.checkpoints.path(ledger.checkpoint_step)
        manifest = read_manifest(directory)

        def frames() -> Iterator[common_pb2.TensorFrame]:
            for name, tensor in read_layers(directory, manifest, 0, manifest.num_layers):
                yield from named_frames(name, tensor)

        self.group.load_state(frames(), manifest.step)
        ledger.restored(manifest.step)

    def replay(self, target: int) -> None:
        """Runs the logged steps after the restored one up to ``target``, each decided as it
        first was (its commit carried by the next, the last one's pending)."""
        m = self.group.config.step_microbatches
        for step in range(self._ledger.step + 1, target + 1):
            logged = self._storage.log.read(step)
            self._runner.replay(RunBatch.split(logged.inputs, logged.targets, logged.side, m))

    # -- after a coordinator restart -----------------------------------------------------------

    def reconcile(self) -> None:
        """After a coordinator restart: adopt the stages as they are, or rebuild."""
        group, ledger, registry = self.group, self._ledger, self.group.registry
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
            and (i.step == ledger.step or (i.step == ledger.step - 1 and i.pending_run_id))
            for i in infos
        )
        behind = (
            [(s, i) for s, i in zip(group.servers, infos, strict=True) if i.step < ledger.step]
            if consistent
            else []
        )
        if behind and group.config.clip_grad_norm is not None:
            consistent = False  # its gradient scale was not saved: replay the step instead
        self._needs_reconcile = False
        ledger.adopt_runs([i.last_run_id for i in infos])
        # A coordinator killed while it sent a run leaves it on the stages it reached, where it
        # may still wait for a neighbour the run never reached (its whole receive deadline, with
        # the stage's run lock held, so every later call would wait behind it). The newest run
        # any stage started is not decided unless it is a behind stage's pending one (decided
        # runs are committed below), and stages that disagree on their newest run show that it
        # did not reach them all: it is aborted everywhere first, which wakes its waits. (A run
        # that reached every stage finished there: prepared, it is aborted below as before.)
        decided = {i.pending_run_id for i in infos if i.pending_run_id and i.step < ledger.step}
        started = {i.last_run_id for i in infos}
        newest = max(started, default=0)
        ours = all(i.job_id == group.job_id for i in infos)
        if len(started) > 1 and newest not in decided and ours:
            group.abort(newest)
        if consistent:
            ahead = max((i.pending_run_id for i in infos if i.step == ledger.step), default=0)
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
                "job %s: resumed with its stages as they were (step %d)", group.job_id, ledger.step
            )
            return
        logger.warning("job %s: stages disagree with the saved state; rebuilding", group.job_id)
        registry.claim([a for a in addresses if a in known], group.job_id)
        self.rebuild(set(addresses) - known)
