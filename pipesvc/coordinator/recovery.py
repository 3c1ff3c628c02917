"""Rebuilding a job's stages from durable state: a new plan and assignment, the checkpoint
restored, the logged steps replayed (see [Note: recovery] in recovery.py); and what leads to a
rebuild: a lost stage, a leaving one, a coordinator restart (``reconcile.reconcile`` decides
whether the stages can be adopted as they are).

[Note: recovery] Before it is decided, a step's batch goes to the write-ahead step log. When a
stage is lost (or a step fails for a reason that is not the caller's), the job gets a new plan
(a spare replaces each lost stage, or the model is re-partitioned over the survivors), every
stage is assigned afresh, restores the newest checkpoint, and the logged steps after it are
replayed; then the failed step runs again. Since each step is deterministic, the caller sees
the same losses and weights as a run without the fault. If the batch cannot be written to the
step log, the step is never decided: its prepared run is aborted on every stage at once
(``StepLogError``), and nothing is committed anywhere.

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

from pipesvc.coordinator import planner
from pipesvc.coordinator.checkpointer import Checkpointer
from pipesvc.coordinator.job_storage import JobStorage
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.reconcile import reconcile
from pipesvc.coordinator.stage_calls import StageLostError, health_of
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.coordinator.step_log import StepLogDamagedError
from pipesvc.coordinator.step_runner import FINAL_ERRORS, StepRunner
from pipesvc.core.health import Health
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.plan import servers_of
from pipesvc.core.tensor_codec import named_frames
from pipesvc.errors import PipesvcError
from pipesvc.observe.metrics import Metrics
from pipesvc.storage.checkpoint import read_layers, read_manifest
from pipesvc.v1 import common_pb2

logger = logging.getLogger(__name__)

__all__ = ["FINAL_ERRORS", "JobStorage", "Recovery"]


class Recovery:
    """Rebuilding a job's stages: recovery from lost stages, migration off leaving ones, and
    after a coordinator restart when reconciling finds the stages disagree with the row."""

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
            self._needs_reconcile = False
            without = reconcile(self.group, self._ledger)
            if without is not None:
                self.rebuild(without)
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
            group.plan = planner.plan_after_loss(
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

    def _way_on(self) -> str:
        """What a job whose logged steps cannot all be replayed can go on from."""
        step = self._ledger.checkpoint_step
        if step < 0:
            return (
                "the job has no checkpoint to go on from: create it again (from the checkpoint it "
                "was created from, if any)"
            )
        path = self._storage.checkpoints.path(step)
        return (
            f"its newest checkpoint, of step {step}, is {str(path)!r}: a new job created with "
            "resume_from= that directory goes on from there"
        )

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
            try:
                logged = self._storage.log.read(step)
            except StepLogDamagedError as exc:
                raise StepLogDamagedError(
                    f"job {self.group.job_id}: {exc}; {self._way_on()}"
                ) from exc
            self._runner.replay(RunBatch.split(logged.inputs, logged.targets, logged.side, m))
