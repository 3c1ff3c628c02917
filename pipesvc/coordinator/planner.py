"""Placing a job on stages: the first plan, and a new plan when stages are lost or leave."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from pipesvc import partition, schedule
from pipesvc.config import JobConfig
from pipesvc.coordinator.registry import StageRecord, StageRegistry
from pipesvc.coordinator.stage_calls import call_stage, health_of
from pipesvc.errors import (
    InvalidArgumentError,
    PlanError,
    ResourceExhaustedError,
    UnknownModelError,
)
from pipesvc.plan import PipelineStage, check_plan
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)

MAX_SIMULATED_ACTIONS = 1 << 14
"""Largest schedule (stages x micro-batches) dry-run at job creation; bigger ones are trusted."""

MAX_WAIT_FOR_STAGES_S = 3600.0
"""Longest a job creation waits for stages when the call itself has no deadline."""

# Bytes per parameter byte a stage holds while training: weights, gradients, optimizer state.
_OPTIMIZER_COPIES = {"adam": 2, "adamw": 2}


def check_schedule(name: str, num_stages: int, num_microbatches: int) -> None:
    """Dry-runs the job's schedule on every stage: order and deadlock freedom.

    Raises:
        InvalidArgumentError: the schedule would deadlock or is malformed.
    """
    if num_stages * num_microbatches > MAX_SIMULATED_ACTIONS:
        return
    schedule.validate(
        [
            schedule.stage_actions(
                name, rank=rank, num_stages=num_stages, num_microbatches=num_microbatches
            )
            for rank in range(num_stages)
        ],
        num_microbatches,
    )


def wait_for_stages(
    registry: StageRegistry,
    config: JobConfig,
    wait_for_stages_s: float,
    call_remaining_s: float | None = None,
) -> None:
    """Waits, up to ``wait_for_stages_s``, until ``config.num_stages`` free stages can build
    the model: for a job created while its stages are still starting and registering. The
    wait takes at most half of what is left of the caller's deadline (``call_remaining_s``),
    so planning still has time, and at most :data:`MAX_WAIT_FOR_STAGES_S`. Returning does not
    promise enough stages: planning then reports what is missing as before.

    Raises:
        InvalidArgumentError: ``wait_for_stages_s`` is negative or not finite.
    """
    if not math.isfinite(wait_for_stages_s) or wait_for_stages_s < 0:
        raise InvalidArgumentError(
            f"wait_for_stages_s ({wait_for_stages_s}) must be a finite number of seconds >= 0"
        )
    limit_s = MAX_WAIT_FOR_STAGES_S if call_remaining_s is None else call_remaining_s / 2
    timeout_s = min(wait_for_stages_s, limit_s)
    if timeout_s <= 0:
        return
    free = registry.wait_free(config.model, config.num_stages, timeout_s)
    if free < config.num_stages:
        logger.info(
            "waited %.1f s for %d free stages that can build %r; %d are free",
            timeout_s,
            config.num_stages,
            config.model,
            free,
        )


def describe(
    registry: StageRegistry, config: JobConfig, timeout_s: float
) -> list[stage_pb2.LayerDescription]:
    """The model's layers, described by a stage that can build it (on the meta device).

    Raises:
        UnknownModelError: no registered stage can build the model.
        PlanError: every stage that could is busy.
    """
    candidates = registry.free(config.model)
    if not candidates:
        known = sorted({m for r in registry.all() for m in r.models})
        if config.model not in known:
            raise UnknownModelError(
                f"model {config.model!r} is not registered on any stage; known models: "
                f"{', '.join(known) or 'none (no stages registered)'}"
            )
        holders = sorted(
            {r.job_id for r in registry.all() if r.job_id and config.model in r.models}
        )
        raise PlanError(
            f"no free stage can build {config.model!r}; every one that can is serving a job "
            f"({', '.join(holders) or 'none: they are unreachable'}). Free stages by closing a "
            "job: client.jobs() lists them, client.get_job(job_id).close() closes one"
        )
    describer = PipelineStage(start_layer=0, end_layer=0, rank=0, address=candidates[0].address)
    reply = call_stage(
        registry,
        describer,
        "Describe",
        stage_pb2.DescribeRequest(
            model=config.model,
            model_args_json=config.model_args_json(),
            input_shape=list(config.input_shape or ()),
            input_dtype=config.input_dtype,
        ),
        timeout_s,
    )
    return list(reply.layers)


def memory_estimate(
    layers: Sequence[stage_pb2.LayerDescription],
    start: int,
    end: int,
    optimizer: str,
    in_flight: int = 0,
) -> int:
    """Bytes a stage needs for layers [start, end): weights, gradients and optimizer state,
    plus ``in_flight`` micro-batches' activations (known when the job gave an input shape)."""
    weights = sum(int(layers[i].parameter_bytes) for i in range(start, end))
    activations = sum(int(layers[i].activation_bytes) for i in range(start, end))
    return weights * (2 + _OPTIMIZER_COPIES.get(optimizer, 1)) + in_flight * activations


def _in_flight(config: JobConfig, num_stages: int) -> list[int]:
    return [
        schedule.max_in_flight(
            config.schedule,
            rank=rank,
            num_stages=num_stages,
            num_microbatches=config.num_microbatches,
        )
        for rank in range(num_stages)
    ]


def _ranges(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    records: Sequence[StageRecord],
) -> list[tuple[int, int]]:
    """Layer ranges for ``records`` (in rank order) under the job's partition method."""
    if config.partition == "memory":
        optimizer = str(config.optimizer.get("name"))
        costs = [memory_estimate(layers, i, i + 1, optimizer) for i in range(len(layers))]
        return partition.fit_capacities(
            costs,
            [r.memory_bytes for r in records],
            per_copy=[int(layer.activation_bytes) for layer in layers],
            copies=_in_flight(config, len(records)),
        )
    costs = [int(layer.num_parameters) for layer in layers]
    return partition.partition(config.partition, costs, len(records))


def _place(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    ranges: Sequence[tuple[int, int]],
    records: Sequence[StageRecord],
) -> list[PipelineStage]:
    plan = []
    in_flight = _in_flight(config, len(records))
    for rank, ((start, end), record) in enumerate(zip(ranges, records, strict=True)):
        optimizer = str(config.optimizer.get("name"))
        need = memory_estimate(layers, start, end, optimizer, in_flight[rank])
        if need > record.memory_bytes:
            held = (
                f" (with {in_flight[rank]} micro-batches of activations in flight)"
                if config.input_shape
                else ""
            )
            raise ResourceExhaustedError(
                f"stage {record.address} would hold layers [{start}, {end}) needing about "
                f"{need / 2**20:.0f} MiB{held}; it has {record.memory_bytes / 2**20:.0f} MiB"
            )
        plan.append(
            PipelineStage(start_layer=start, end_layer=end, rank=rank, address=record.address)
        )
    check_plan(plan, len(layers))
    return plan


def first_plan(
    registry: StageRegistry,
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    job_id: str,
) -> list[PipelineStage]:
    """Partitions the model over free stages and claims them for ``job_id``.

    Raises:
        InvalidArgumentError: more stages than layers.
        PlanError: fewer free stages than ``num_stages``.
        ResourceExhaustedError: a stage's share does not fit its memory.
    """
    partition.partition("uniform", [0] * len(layers), config.num_stages)  # checks the counts
    check_schedule(config.schedule, config.num_stages, config.num_microbatches)
    candidates = registry.free(config.model)
    if config.num_stages > len(candidates):
        raise PlanError(
            f"num_stages ({config.num_stages}) exceeds the free stages that can build "
            f"{config.model!r} ({len(candidates)} of {len(registry.all())} registered)"
        )
    chosen = candidates[: config.num_stages]
    plan = _place(config, layers, _ranges(config, layers, chosen), chosen)
    if not registry.claim([s.address for s in plan], job_id):
        raise PlanError("stages were taken by another job while planning; try again")
    return plan


def replan(
    registry: StageRegistry,
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    plan: Sequence[PipelineStage],
    lost: set[str],
    job_id: str,
    health_timeout_s: float,
) -> list[PipelineStage]:
    """A plan without the ``lost`` stages: each replaced by a healthy free spare where there
    are enough, else the model re-partitioned over the survivors and the spares.

    Raises:
        PlanError: no stage is left.
        ResourceExhaustedError: the survivors' memory cannot hold the model.
    """
    for address in lost:
        registry.mark_lost(address)
    survivors = [s for s in plan if s.address not in lost]
    candidates = [r for r in registry.free(config.model) if r.address not in lost]
    health = health_of(registry, [r.address for r in candidates], health_timeout_s)
    spares = [r for r in candidates if health[r.address] == "SERVING"]
    records = {r.address: r for r in registry.all()}
    if len(spares) >= len(plan) - len(survivors):
        replacements = iter(spares)
        chosen = [s.address if s.address not in lost else next(replacements).address for s in plan]
        ranges = [(s.start_layer, s.end_layer) for s in plan]
    else:
        chosen = [s.address for s in survivors] + [r.address for r in spares]
        if not chosen:
            raise PlanError(f"job {job_id}: every stage is lost and no spare is registered")
        count = min(len(chosen), len(layers))
        chosen = chosen[:count]
        ranges = _ranges(config, layers, [records[a] for a in chosen])
        logger.warning(
            "job %s: no spare for every lost stage; re-partitioning over %d stages", job_id, count
        )
    new_plan = _place(config, layers, ranges, [records[a] for a in chosen])
    registry.claim([a for a in chosen if records[a].job_id != job_id], job_id)
    for stage in new_plan:
        registry.place(
            stage.address, rank=stage.rank, start_layer=stage.start_layer, end_layer=stage.end_layer
        )
    return new_plan
