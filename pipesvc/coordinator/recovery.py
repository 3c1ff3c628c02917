"""Recovery, migration, checkpoints and reconciling a job with its stages (see [Note: recovery]
in job.py).

``RecoveryMixin`` is half of JobDriver: the steps are in job.py; everything that rebuilds a
job's stages from durable state is here. It runs with the job's lock held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipesvc import microbatch
from pipesvc.checkpoint import CheckpointStore, CheckpointWriter, read_layers, read_manifest
from pipesvc.config import JobConfig, config_to_proto
from pipesvc.coordinator import planner
from pipesvc.coordinator.registry import StageRegistry
from pipesvc.coordinator.stage_calls import (
    Deadlines,
    StageLostError,
    call_stage,
    health_of,
    where,
)
from pipesvc.coordinator.state_db import JobRecord, StateDB
from pipesvc.coordinator.state_transfer import load_into_stages
from pipesvc.errors import InternalError, PipesvcError
from pipesvc.metrics import Metrics
from pipesvc.plan import PipelineStage
from pipesvc.step_log import StepLog
from pipesvc.tensor_codec import named_frames, read_named_frames
from pipesvc.v1 import common_pb2, stage_pb2

logger = logging.getLogger(__name__)


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


class RecoveryMixin:
    """Rebuilding a job's stages: recovery from lost stages, migration off leaving ones,
    checkpoints, and reconciling after a coordinator restart."""

    job_id: str
    config: JobConfig
    layers: list[stage_pb2.LayerDescription]
    plan: list[PipelineStage]
    epoch: int
    step: int
    checkpoint_step: int
    recoveries: int
    _registry: StageRegistry
    _deadlines: Deadlines
    _storage: JobStorage
    _metrics: Metrics
    _pool: futures.ThreadPoolExecutor
    _run_id: int
    _needs_reconcile: bool
    _replay_target: int | None
    _checked_at: float

    # Provided by JobDriver.
    def _persist(self) -> None:
        raise NotImplementedError

    def record(self) -> JobRecord:
        raise NotImplementedError

    def _call_all(self, method: str, make: Any, timeout_s: float, **kw: Any) -> list[Any]:
        raise NotImplementedError

    def _abort(self, run_id: int) -> None:
        raise NotImplementedError

    def _train_once(
        self,
        input_mbs: list[torch.Tensor],
        target_mbs: list[torch.Tensor],
        log: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> float:
        raise NotImplementedError

    def _stream(self, kind: int) -> Iterator[common_pb2.TensorFrame]:
        raise NotImplementedError

    def _plan_text(self) -> str:
        raise NotImplementedError

    # -- readiness, recovery, migration --------------------------------------------------------

    def _ensure_ready(self) -> None:
        if self._needs_reconcile:
            self._reconcile()
        # Between back-to-back steps the watchdog of the last step has just seen every stage;
        # a fresh health round trip per step would only add latency.
        if time.monotonic() - self._checked_at < self._deadlines.health_interval_s:
            return
        statuses = health_of(
            self._registry, [s.address for s in self.plan], self._deadlines.health_s
        )
        lost = {a for a, s in statuses.items() if s == "UNREACHABLE"}
        if lost:
            raise StageLostError(f"stages {', '.join(sorted(lost))} are unreachable", lost)
        leaving = {a for a, s in statuses.items() if s != "SERVING"}
        if leaving:
            self._migrate(leaving)
        self._checked_at = time.monotonic()

    def _recover(self, lost: set[str], cause: PipesvcError | None) -> None:
        started = time.monotonic()
        logger.warning(
            "job %s: recovering at step %d without %s (cause: %s)",
            self.job_id,
            self.step,
            ", ".join(sorted(lost)) or "losing a stage",
            cause,
        )
        self._rebuild(lost)
        self.recoveries += 1
        self._metrics.inc("recoveries_total")
        logger.warning(
            "job %s: recovered in %.2f s; plan now %s",
            self.job_id,
            time.monotonic() - started,
            self._plan_text(),
        )

    def _migrate(self, leaving: set[str]) -> None:
        """Moves layers off stages that are shutting down (not a failure): checkpoint, replan."""
        logger.info(
            "job %s: moving layers off leaving stages %s", self.job_id, ", ".join(sorted(leaving))
        )
        self._checkpoint()
        old = list(self.plan)
        self._rebuild(leaving)
        for stage in old:
            if stage.address in leaving:
                self._release(stage)

    def _release(self, stage: PipelineStage) -> None:
        """Tells a stage to drop this job (best effort: it may be gone)."""
        try:
            call_stage(
                self._registry,
                stage,
                "Release",
                stage_pb2.ReleaseRequest(job_id=self.job_id),
                self._deadlines.abort_s,
            )
        except PipesvcError as exc:
            logger.warning("job %s: release of %s failed: %s", self.job_id, where(stage), exc)

    def _rebuild(self, without: set[str]) -> None:
        """New plan without ``without``; assign, restore the checkpoint, replay the log."""
        if without:
            self.plan = planner.replan(
                self._registry,
                self.config,
                self.layers,
                self.plan,
                without,
                self.job_id,
                self._deadlines.health_s,
            )
        self.epoch += 1
        # A recovery interrupted mid-replay keeps its target: the steps committed before it.
        target = self.step if self._replay_target is None else self._replay_target
        self._replay_target = target
        self._assign()
        self._restore()
        self._persist()
        for step in range(self.step + 1, target + 1):
            inputs, targets = self._storage.log.read(step)
            m = self.config.num_microbatches
            self._train_once(microbatch.split(inputs, m), microbatch.split(targets, m), None)
        self._replay_target = None
        self._persist()

    def _assign(self) -> None:
        spec = config_to_proto(self.config)
        plan = self.plan

        def assign(stage: PipelineStage) -> stage_pb2.AssignRequest:
            downstream = plan[stage.rank + 1].address if stage.rank + 1 < len(plan) else ""
            return stage_pb2.AssignRequest(
                job_id=self.job_id,
                plan_epoch=self.epoch,
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

        self._call_all("Assign", assign, self._deadlines.control_s)

    def _restore(self) -> None:
        """Loads the newest checkpoint into freshly assigned stages (or keeps the seed's init)."""
        if self.checkpoint_step < 0:
            self.step = 0
            return
        directory = self._storage.checkpoints.path(self.checkpoint_step)
        manifest = read_manifest(directory)

        def frames() -> Iterator[common_pb2.TensorFrame]:
            for name, tensor in read_layers(directory, manifest, 0, manifest.num_layers):
                yield from named_frames(name, tensor)

        load_into_stages(
            self._registry,
            self.job_id,
            self.plan,
            self.layers,
            frames(),
            timeout_s=self._deadlines.control_s,
            step=manifest.step,
            pool=self._pool,
        )
        self.step = manifest.step

    def _checkpoint(self) -> None:
        """Streams every stage's weights and optimizer state to a new checkpoint on disk."""
        started = time.monotonic()
        directory = self._storage.checkpoints.path(self.step)
        writer = CheckpointWriter(directory)
        try:
            for name, tensor in read_named_frames(self._stream(common_pb2.CHECKPOINT)):
                writer.add(name, tensor)
            # Coverage is by layer count (see [Note: checkpoint coverage]); that each layer
            # sent all its tensors is checked here, against the model, before the step log
            # behind this checkpoint is pruned.
            expected = {f"{layer.index}.{t.name}" for layer in self.layers for t in layer.tensors}
            missing = sorted(expected - writer.keys)
            if missing:
                raise InternalError(
                    f"the stages sent a checkpoint without {len(missing)} of the model's "
                    f"{len(expected)} tensors, e.g. {missing[:5]}"
                )
            writer.finish(
                job_id=self.job_id,
                step=self.step,
                spec=self.record().spec,
                num_layers=len(self.layers),
                plan=self.record().plan,
            )
        except BaseException:
            writer.discard()
            raise
        self.checkpoint_step = self.step
        self._persist()
        self._storage.log.prune(self.step)
        self._storage.checkpoints.prune()
        logger.info(
            "job %s: checkpoint at step %d in %.2f s",
            self.job_id,
            self.step,
            time.monotonic() - started,
        )

    def _reconcile(self) -> None:
        """After a coordinator restart: adopt the stages as they are, or rebuild."""
        deadline = time.monotonic() + self._deadlines.reconcile_s
        addresses = [s.address for s in self.plan]
        known = set()
        while time.monotonic() < deadline:
            known = {r.address for r in self._registry.all() if r.alive}
            if set(addresses) <= known:
                break
            time.sleep(0.2)
        consistent = set(addresses) <= known
        infos: list[Any] = []
        if consistent:
            try:
                infos = self._call_all("Info", lambda s: stage_pb2.InfoRequest(), 5.0)
            except PipesvcError:
                consistent = False
        consistent = consistent and all(
            i.job_id == self.job_id and i.plan_epoch == self.epoch and i.step == self.step
            for i in infos
        )
        self._needs_reconcile = False
        if consistent:
            self._run_id = max([self._run_id, *(i.last_run_id for i in infos)])
            pending = max(i.pending_run_id for i in infos)
            if pending:
                self._abort(pending)
            self._registry.claim(addresses, self.job_id)
            for stage in self.plan:
                self._registry.place(
                    stage.address,
                    rank=stage.rank,
                    start_layer=stage.start_layer,
                    end_layer=stage.end_layer,
                )
            logger.info(
                "job %s: resumed with its stages as they were (step %d)", self.job_id, self.step
            )
            return
        self._run_id = max([self._run_id, *(i.last_run_id for i in infos)], default=self._run_id)
        logger.warning("job %s: stages disagree with the saved state; rebuilding", self.job_id)
        self._registry.claim([a for a in addresses if a in known], self.job_id)
        self._rebuild(set(addresses) - known)
