"""Measuring a job's stages and moving its layers between steps (see [Note: throughput plan]
in ``pipesvc.core.throughput``).

[Note: replan] ``Replanner.apply`` moves a running job to a new plan between two steps: it
commits the decided step everywhere, writes a checkpoint of every stage's weights and
optimizer state, gives every stage of the new plan its range under a new plan epoch, and loads
the checkpoint into them; stages that leave the plan drop the job and go back to the free
pool. Nothing is replayed: the checkpoint is at the last step, so the next step starts from
exactly the state the old plan had, and training goes on with identical numbers.

A job created with ``partition="throughput"`` starts balanced by parameters, because nothing
is measured yet. After ``PROBE_STEPS`` training steps (the probe: real steps, so no work is
wasted) it measures its stages and moves to the throughput plan if that is predicted at least
``MIN_GAIN`` faster. With ``rebalance`` on, it measures again every ``REBALANCE_EVERY`` steps
and moves when the same holds, so work leaves a stage that slowed down and goes to a faster
free stage that registered.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from concurrent import futures
from dataclasses import dataclass

import grpc

from pipesvc.coordinator import placement
from pipesvc.coordinator.recovery import Recovery
from pipesvc.coordinator.registry import StageRecord
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.core import throughput
from pipesvc.core.plan import PipelineStage
from pipesvc.errors import FailedPreconditionError, PlanError
from pipesvc.v1 import stage_pb2
from pipesvc.wire.rpc_status import error_from_rpc

logger = logging.getLogger(__name__)

PROBE_STEPS = 3
"""Training steps a ``throughput`` job runs on its first plan before it measures."""
REBALANCE_EVERY = 20
"""Steps between measurements of a job with ``rebalance`` on."""
MIN_GAIN = 0.1
"""A plan found by itself is taken only if its predicted bottleneck is this share smaller."""
CALIBRATE_S = 0.5
"""Seconds each stage times its calibration product (all stages at once, so stages sharing a
host's cores measure the share they get while they all work)."""


@dataclass(frozen=True, slots=True)
class Measurements:
    """One measurement of a job: the model's layer costs per micro-batch, and every candidate
    stage's rate (the job's stages first, in rank order, then the free stages)."""

    costs: throughput.LayerCosts
    stages: list[StageRecord]
    rates: list[throughput.StageRate]
    current_s: list[float]
    """The current plan's predicted seconds per micro-batch, per rank."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What a replan found: the plan (the old one when nothing moved) and, for the
    ``throughput`` partition, the predicted seconds per micro-batch of each rank before and
    after."""

    plan: list[PipelineStage]
    moved: bool
    current_s: list[float]
    predicted_s: list[float]
    partition: str


class Replanner:
    """Measures the stages of one job and moves its layers (called with the job's lock held)."""

    def __init__(self, *, group: StageGroup, recovery: Recovery) -> None:
        self._group = group
        self._recovery = recovery

    def measure(self) -> Measurements:
        """Profiles the job's stages and calibrates them and the free stages, all at once.

        Raises:
            FailedPreconditionError: a layer has no timings yet (no training step on this
                plan).
            PipesvcError: a stage did not answer.
        """
        group = self._group
        records = {r.address: r for r in group.registry.all()}
        stages = [records[s.address] for s in group.plan] + group.registry.free(group.config.model)
        timeout_s = group.deadlines.control_s + CALIBRATE_S

        def profile(index: int) -> stage_pb2.StageProfile:
            record = stages[index]
            job_id = group.job_id if index < len(group.plan) else ""
            request = stage_pb2.ProfileRequest(job_id=job_id, calibrate_s=CALIBRATE_S)
            try:
                reply: stage_pb2.StageProfile = group.registry.stub(record.address).Profile(
                    request, timeout=timeout_s
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, where=f"stage {record.address}") from exc
            return reply

        with futures.ThreadPoolExecutor(max_workers=len(stages)) as pool:
            profiles = list(pool.map(profile, range(len(stages))))
        return _measurements(group.plan, len(group.layers), stages, profiles)

    def choose(self, partition: str, *, min_gain: float = 0.0) -> Decision:
        """The plan ``partition`` gives (``throughput``: from a new measurement, and only if
        predicted at least ``min_gain`` faster than the current plan); nothing moves.

        Raises:
            FailedPreconditionError: ``throughput`` before any training step on this plan.
            ResourceExhaustedError: no plan of the method fits the stages' memory.
            PipesvcError: a stage did not answer the measurement.
        """
        group = self._group
        config = dataclasses.replace(group.config, partition=partition)
        current = list(group.plan)
        current_s: list[float] = []
        predicted_s: list[float] = []
        if partition == "throughput":
            measured = self.measure()
            plan, predicted_s = placement.throughput_plan(
                config, group.layers, measured.costs, measured.stages, measured.rates
            )
            current_s = measured.current_s
            if max(predicted_s) > max(current_s) * (1 - min_gain):
                plan, predicted_s = current, current_s
        else:
            records = {r.address: r for r in group.registry.all()}
            plan = placement.plan_on(config, group.layers, [records[s.address] for s in current])
        return Decision(
            plan=plan,
            moved=plan != current,
            current_s=current_s,
            predicted_s=predicted_s,
            partition=partition,
        )

    def apply(self, decision: Decision) -> None:
        """Moves the job to ``decision``'s plan (see [Note: replan]) and takes its partition
        method; nothing moves if the job is on that plan already.

        Raises:
            PlanError: a chosen free stage was taken by another job meanwhile.
            PipesvcError: a stage failed while the layers moved (the job recovers from the
                checkpoint written first).
        """
        group = self._group
        group.config = dataclasses.replace(group.config, partition=decision.partition)
        if decision.plan != group.plan:
            self._move(decision.plan)
        self._recovery.persist()

    def _move(self, plan: list[PipelineStage]) -> None:
        group, registry = self._group, self._group.registry
        old = list(group.plan)
        self._recovery.checkpoint()  # commits the decided step first
        kept = {s.address for s in plan}
        joining = [s.address for s in plan if s.address not in {o.address for o in old}]
        if joining and not registry.claim(joining, group.job_id):
            raise PlanError("free stages were taken by another job while replanning; try again")
        leaving = [s for s in old if s.address not in kept]
        for stage in leaving:
            group.release(stage)
        registry.unclaim([s.address for s in leaving])
        for stage in plan:
            registry.place(
                stage.address,
                rank=stage.rank,
                start_layer=stage.start_layer,
                end_layer=stage.end_layer,
            )
        logger.warning(
            "job %s: moving to a new plan at step %d: %s",
            group.job_id,
            self._recovery.state.step,
            ", ".join(f"[{s.start_layer}, {s.end_layer}) on {s.address}" for s in plan),
        )
        group.plan = plan
        self._recovery.rebuild(set())


def _measurements(
    plan: list[PipelineStage],
    num_layers: int,
    stages: list[StageRecord],
    profiles: list[stage_pb2.StageProfile],
) -> Measurements:
    """Layer costs from the job's stages' timings, each layer's time scaled by its stage's
    calibrated speed to work that any stage does at its own speed."""
    work: dict[int, float] = {}
    boundary: dict[int, int] = {}
    for stage, profile in zip(plan, profiles, strict=False):
        for layer in profile.layers:
            if stage.start_layer <= layer.index < stage.end_layer:
                work[layer.index] = (layer.forward_s + layer.backward_s) * profile.speed
                boundary[layer.index] = layer.output_bytes
    missing = [i for i in range(num_layers) if i not in work]
    if missing:
        raise FailedPreconditionError(
            f"layer {missing[0]} has no timings on its stage yet; train a step on this plan "
            "before planning for throughput"
        )
    known = [p.send_bytes_per_s for p in profiles[: len(plan)] if p.send_bytes_per_s > 0]
    default_rate = statistics.median(known) if known else float("inf")
    rates = [
        throughput.StageRate(
            speed=max(profile.speed, 1e-9),
            memory_bytes=record.memory_bytes,
            link_bytes_per_s=profile.send_bytes_per_s or default_rate,
        )
        for record, profile in zip(stages, profiles, strict=True)
    ]
    costs = throughput.LayerCosts(
        work=[work[i] for i in range(num_layers)],
        boundary_bytes=[boundary[i] for i in range(num_layers)],
    )
    ranges = [(s.start_layer, s.end_layer) for s in plan]
    current_s = throughput.predict(costs, rates[: len(plan)], ranges)
    return Measurements(costs, stages, rates, current_s)
