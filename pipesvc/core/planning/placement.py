"""Placing a job's layers on stages, as a pure function of what the caller found.

Given the stages (their addresses and memory), their health and the model's layer descriptions,
this decides a plan or raises; it makes no call and changes no registry, so it is unit-tested
without processes. ``planner`` gathers the inputs (the registry's records, health checks) and
applies the result (claims, places).

It imports nothing from the rest of the coordinator, so the stages are anything with the
fields below (the registry's ``StageRecord`` is one).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from pipesvc.core import schedule, schedule_sim
from pipesvc.core.config import JobConfig
from pipesvc.core.health import Health
from pipesvc.core.link_codecs import host_of
from pipesvc.core.optim import NO_OPTIMIZER
from pipesvc.core.plan import PipelineStage, check_plan, replicas_of, servers_of
from pipesvc.core.planning import partition, throughput
from pipesvc.errors import InvalidArgumentError, PlanError, ResourceExhaustedError
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)

MAX_SIMULATED_ACTIONS = 1 << 14
"""Largest schedule (stages x micro-batches) dry-run at job creation; bigger ones are trusted."""

# Bytes per parameter byte a stage holds while training: weights, gradients, optimizer state.
_OPTIMIZER_COPIES = {"adam": 2, "adamw": 2}


class Stage(Protocol):
    """What placement needs to know of a stage server."""

    @property
    def address(self) -> str: ...

    @property
    def memory_bytes(self) -> int: ...


def check_schedule(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> None:
    """Dry-runs the job's schedule on every stage: order and deadlock freedom.

    Raises:
        InvalidArgumentError: the schedule would deadlock or is malformed.
    """
    if num_stages * num_microbatches * virtual_stages > MAX_SIMULATED_ACTIONS:
        return
    schedule_sim.validate(
        schedule.all_stage_actions(
            name,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            virtual_stages=virtual_stages,
        ),
        num_microbatches,
    )


def memory_estimate(
    layers: Sequence[stage_pb2.LayerDescription],
    start: int,
    end: int,
    optimizer: str,
    in_flight: int = 0,
    precision: str = "fp32",
) -> int:
    """Bytes a stage needs for layers [start, end): weights, and gradients and optimizer state
    of the parameters that train (all of them unless the stage says otherwise), halved for
    weights stored in bfloat16; plus ``in_flight`` micro-batches' activations (known when the
    job gave an input shape). Parameters frozen by ``trainable`` patterns are still counted
    as training: the planner does not see parameter names."""
    chosen = range(start, end)
    weights = sum(int(layers[i].parameter_bytes) for i in chosen)
    trains = sum(
        int(layers[i].trainable_bytes)
        if layers[i].HasField("trainable_bytes")
        else int(layers[i].parameter_bytes)
        for i in chosen
    )
    activations = sum(int(layers[i].activation_bytes) for i in chosen)
    if optimizer == NO_OPTIMIZER:  # an inference job: weights only
        trains = 0
    state = weights + trains * (1 + _OPTIMIZER_COPIES.get(optimizer, 1))
    if precision == "bf16":
        state //= 2
    return state + in_flight * activations


def _trainable_bytes(layer: stage_pb2.LayerDescription) -> int:
    if layer.HasField("trainable_bytes"):
        return int(layer.trainable_bytes)
    return int(layer.parameter_bytes)


def _in_flight(config: JobConfig, num_stages: int) -> list[int]:
    """Micro-batches in flight per rank; with chunks, a micro-batch's chunks in flight over
    the chunks (each keeps a V-th of the stage's activations), rounded up."""
    v = config.virtual_stages
    return [
        -(
            -schedule.max_in_flight(
                config.schedule,
                rank=rank,
                num_stages=num_stages,
                num_microbatches=config.num_microbatches,
                virtual_stages=v,
            )
            // v
        )
        for rank in range(num_stages)
    ]


def _ranges(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    stages: Sequence[Stage],
) -> list[tuple[int, int]]:
    """Layer ranges for ``stages`` (in rank order) under the job's partition method."""
    if config.partition == "memory":
        optimizer = str(config.optimizer.get("name"))
        costs = [
            memory_estimate(layers, i, i + 1, optimizer, precision=config.precision)
            for i in range(len(layers))
        ]
        return partition.fit_capacities(
            costs,
            [s.memory_bytes for s in stages],
            per_copy=[int(layer.activation_bytes) for layer in layers],
            copies=_in_flight(config, len(stages)),
        )
    costs = [int(layer.num_parameters) for layer in layers]
    return partition.partition(config.partition, costs, len(stages) * config.virtual_stages)


def _place(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    ranges: Sequence[tuple[int, int]],
    stages: Sequence[Stage],
) -> list[PipelineStage]:
    """Ranges in layer order onto ``stages`` in rank order: range ``i`` on rank ``i % P`` as
    its chunk ``i // P`` (one chunk per stage unless the job has virtual stages)."""
    count = len(stages)
    if len(ranges) != count * config.virtual_stages:
        raise PlanError(
            f"{len(ranges)} layer ranges for {count} stages x {config.virtual_stages} chunks"
        )
    in_flight = _in_flight(config, count)
    optimizer = str(config.optimizer.get("name"))
    for rank, stage in enumerate(stages):
        held = ranges[rank::count]
        need = sum(
            memory_estimate(layers, a, b, optimizer, in_flight[rank], precision=config.precision)
            for a, b in held
        )
        if need > stage.memory_bytes:
            flight = (
                f" (with {in_flight[rank]} micro-batches of activations in flight)"
                if config.input_shape
                else ""
            )
            what = ", ".join(f"[{a}, {b})" for a, b in held)
            raise ResourceExhaustedError(
                f"stage {stage.address} would hold layers {what} needing about "
                f"{need / 2**20:.0f} MiB{flight}; it has {stage.memory_bytes / 2**20:.0f} MiB"
            )
    plan = [
        PipelineStage(
            start_layer=start,
            end_layer=end,
            rank=i % count,
            address=stages[i % count].address,
            chunk=i // count,
        )
        for i, (start, end) in enumerate(ranges)
    ]
    check_plan(plan, len(layers))
    return plan


def plan_on(
    config: JobConfig, layers: Sequence[stage_pb2.LayerDescription], stages: Sequence[Stage]
) -> list[PipelineStage]:
    """The job's partition method over ``stages`` in rank order.

    Raises:
        ResourceExhaustedError: a stage's share does not fit its memory.
    """
    return _place(config, layers, _ranges(config, layers, stages), stages)


def throughput_plan(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    costs: throughput.LayerCosts,
    stages: Sequence[Stage],
    rates: Sequence[throughput.StageRate],
) -> tuple[list[PipelineStage], list[float]]:
    """``config.num_stages`` of ``stages`` (each at the rate with its index), their order and
    their ranges, for the fastest step within every chosen stage's memory (see [Note:
    throughput plan] in ``pipesvc.core.planning.throughput``); and each rank's predicted seconds per
    micro-batch.

    Raises:
        ResourceExhaustedError: no choice of stages and ranges fits their memory.
    """
    optimizer = str(config.optimizer.get("name"))
    in_flight = _in_flight(config, config.num_stages)

    @functools.cache
    def need(start: int, end: int, rank: int) -> int:
        return memory_estimate(
            layers, start, end, optimizer, in_flight[rank], precision=config.precision
        )

    found = throughput.plan(costs, rates, config.num_stages, need)
    plan = [
        PipelineStage(start_layer=start, end_layer=end, rank=rank, address=stages[index].address)
        for rank, ((start, end), index) in enumerate(zip(found.ranges, found.stages, strict=True))
    ]
    check_plan(plan, len(layers))
    return plan, found.stage_seconds


def first_plan(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    free: Sequence[Stage],
    num_registered: int,
) -> list[PipelineStage]:
    """Partitions the model over the first ``num_stages`` of the ``free`` stages (in the
    registry's order); ``num_registered`` (all stages, free or not) is for the error.

    Raises:
        InvalidArgumentError: more stages than layers, or a malformed schedule.
        PlanError: fewer free stages than ``num_stages``.
        ResourceExhaustedError: a stage's share does not fit its memory.
    """
    ranges = config.num_stages * config.virtual_stages
    if config.virtual_stages > 1 and ranges > len(layers):
        raise InvalidArgumentError(
            f"num_stages x virtual_stages ({config.num_stages} x {config.virtual_stages}) "
            f"exceeds num_layers ({len(layers)}); every layer range needs at least one layer"
        )
    partition.partition("uniform", [0] * len(layers), ranges)  # checks the counts
    check_schedule(
        config.schedule, config.num_stages, config.num_microbatches, config.virtual_stages
    )
    if config.total_stages > len(free):
        wanted = (
            f"num_stages x data_parallel ({config.num_stages} x {config.data_parallel})"
            if config.data_parallel > 1
            else f"num_stages ({config.num_stages})"
        )
        raise PlanError(
            f"{wanted} exceeds the free stages that can build {config.model!r} ({len(free)} of "
            f"{num_registered} registered)"
        )
    if config.data_parallel == 1:
        return plan_on(config, layers, free[: config.num_stages])
    slots = replica_layout(config, layers, free[: config.total_stages])
    return replicated_plan(config, layers, slots)


def replicated_plan(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    slots: Sequence[Sequence[Stage]],
) -> list[PipelineStage]:
    """The job's partition method over each replica's stages (``slots[replica][rank]``), cut
    the same way in every replica: a rank's share must fit the smallest of its stages.

    Raises:
        ResourceExhaustedError: a stage's share does not fit its memory.
    """
    smallest = [min(column, key=lambda s: s.memory_bytes) for column in zip(*slots, strict=True)]
    return _place_replicas(config, layers, _ranges(config, layers, smallest), slots)


def _place_replicas(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    ranges: Sequence[tuple[int, int]],
    slots: Sequence[Sequence[Stage]],
) -> list[PipelineStage]:
    """``ranges`` on each replica's stages (``slots[replica][rank]``), replica by replica."""
    plan = [
        dataclasses.replace(stage, replica=replica)
        for replica, stages in enumerate(slots)
        for stage in _place(config, layers, ranges, stages)
    ]
    check_plan(plan, len(layers))
    return plan


def replica_layout(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    stages: Sequence[Stage],
) -> list[list[Stage]]:
    """Which of ``stages`` (``num_stages x data_parallel`` of them, in registration order)
    holds each (replica, rank): ``slots[replica][rank]``.

    [Note: replica placement] Two layouts are weighed by the bytes a step sends between hosts
    (a host is the address's host part). Stages are first ordered by host, hosts in the order
    their first stage registered. "Pipelines together" fills replica 0's ranks, then replica
    1's, ...: neighbours in a pipeline share hosts, and each step's activations and their
    gradients (``2 x`` the boundary layers' activation bytes per micro-batch, when the job
    gave an input shape) stay on a host where they can. "Ranks together" fills rank 0 of every
    replica, then rank 1, ...: the replicas of a rank share hosts, and the gradient sum (about
    ``2 x`` the rank's trainable bytes per step for a ring all-reduce) stays on a host. The
    layout whose cross-host bytes are fewer wins; a tie (one host, or nothing known) keeps
    pipelines together, which on one host is plain registration order.
    """
    replicas, ranks = config.data_parallel, config.num_stages
    first_seen: dict[str, int] = {}
    for index, stage in enumerate(stages):
        first_seen.setdefault(host_of(stage.address), index)
    ordered = sorted(stages, key=lambda s: first_seen[host_of(s.address)])
    together = [list(ordered[r * ranks : (r + 1) * ranks]) for r in range(replicas)]
    by_rank = [[ordered[k * replicas + r] for k in range(ranks)] for r in range(replicas)]
    if len(first_seen) == 1:
        return together
    method = "parameters" if config.partition == "parameters" else "uniform"
    ranges = partition.partition(method, [int(layer.num_parameters) for layer in layers], ranks)
    boundary = [
        2 * config.num_microbatches * int(layers[end - 1].activation_bytes)
        for _, end in ranges[:-1]
    ]
    grads = [2 * sum(_trainable_bytes(layers[i]) for i in range(a, b)) for a, b in ranges]

    def cross_host_bytes(slots: list[list[Stage]]) -> int:
        total = 0
        for pipeline in slots:
            for k, sent in enumerate(boundary):
                if host_of(pipeline[k].address) != host_of(pipeline[k + 1].address):
                    total += sent
        for k, size in enumerate(grads):
            if len({host_of(pipeline[k].address) for pipeline in slots}) > 1:
                total += size
        return total

    return by_rank if cross_host_bytes(by_rank) < cross_host_bytes(together) else together


def replan(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    plan: Sequence[PipelineStage],
    lost: set[str],
    *,
    candidates: Sequence[Stage],
    health: Mapping[str, Health],
    stages: Mapping[str, Stage],
    job_id: str,
) -> list[PipelineStage]:
    """A plan without the ``lost`` stages: each replaced by a spare (a free ``candidate``
    whose ``health`` is SERVING, in order) where there are enough, else the model
    re-partitioned over the survivors and the spares. ``stages`` holds every stage by address
    (the survivors' memory is read there).

    Raises:
        PlanError: no stage is left.
        ResourceExhaustedError: the survivors' memory cannot hold the model.
    """
    survivors = [s for s in plan if s.address not in lost]
    spares = [
        c for c in candidates if c.address not in lost and health[c.address] == Health.SERVING
    ]
    if len(replicas_of(plan)) > 1:
        return _replan_replicas(config, layers, plan, lost, spares, stages, job_id)
    servers = servers_of(plan)
    if len(spares) >= len([s for s in servers if s.address in lost]):
        replacements = iter(spares)
        chosen = [
            s.address if s.address not in lost else next(replacements).address for s in servers
        ]
        ranges = [(s.start_layer, s.end_layer) for s in plan]
    else:
        chosen = [s.address for s in servers_of(survivors)] + [c.address for c in spares]
        if not chosen:
            raise PlanError(f"job {job_id}: every stage is lost and no spare is registered")
        count = min(len(chosen), len(layers) // config.virtual_stages)
        chosen = chosen[:count]
        ranges = _ranges(config, layers, [stages[a] for a in chosen])
        logger.warning(
            "job %s: no spare for every lost stage; re-partitioning over %d stages", job_id, count
        )
    return _place(config, layers, ranges, [stages[a] for a in chosen])


def _replan_replicas(
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    plan: Sequence[PipelineStage],
    lost: set[str],
    spares: Sequence[Stage],
    stages: Mapping[str, Stage],
    job_id: str,
) -> list[PipelineStage]:
    """A replicated plan without the ``lost`` stages (see [Note: replicas]): each replaced by
    a spare in its place, replica by replica while the spares last; the replicas left with a
    lost stage are dropped if ``min_replicas`` allows. The cuts never change.

    Raises:
        PlanError: too few spares, and dropping would go below ``min_replicas``.
        ResourceExhaustedError: a spare's memory cannot hold its share.
    """
    spare = list(spares)
    kept: list[list[Stage]] = []
    dropped = []
    for pipeline in replicas_of(plan):
        servers = servers_of(pipeline)
        missing = [s for s in servers if s.address in lost]
        if len(missing) > len(spare):
            dropped.append(pipeline[0].replica)
            continue
        kept.append([stages[s.address] if s.address not in lost else spare.pop(0) for s in servers])
    floor = config.data_parallel if config.min_replicas is None else config.min_replicas
    if dropped and len(kept) < floor:
        raise PlanError(
            f"job {job_id}: stages {', '.join(sorted(lost))} are lost and no spare is free for "
            f"replicas {dropped}; {len(kept)} replicas would be left, below min_replicas "
            f"({floor})"
        )
    if dropped:
        logger.warning(
            "job %s: no spare for every lost stage; dropping replicas %s (%d left)",
            job_id,
            dropped,
            len(kept),
        )
    ranges = [(s.start_layer, s.end_layer) for s in replicas_of(plan)[0]]
    return _place_replicas(config, layers, ranges, kept)
