"""Placing a job on stages: the first plan, and a new plan when stages are lost or leave.

This is the half that talks to the registry and the stages (describing the model, waiting for
stages, claiming them); what the plan is, given the stages and their health, is decided in
``placement`` without any call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping, Sequence

from pipesvc.coordinator.stage_calls import call_stage
from pipesvc.coordinator.stage_registry import REFUSALS_KEPT_S, StageRecord, StageRegistry
from pipesvc.core.config import JobConfig
from pipesvc.core.health import Health
from pipesvc.core.plan import PipelineStage, servers_of
from pipesvc.core.planning import placement
from pipesvc.errors import (
    InvalidArgumentError,
    PlanError,
    ResourceExhaustedError,
    UnknownModelError,
)
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)

MAX_WAIT_FOR_STAGES_S = 3600.0
"""Longest a job creation waits for stages when the call itself has no deadline."""


def wait_for_stages(
    registry: StageRegistry,
    config: JobConfig,
    wait_for_stages_s: float,
    call_remaining_s: float | None = None,
) -> None:
    """Waits, up to ``wait_for_stages_s``, until ``config.total_stages`` free stages can build
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
    free = registry.wait_free(config.model, config.total_stages, timeout_s)
    if free < config.total_stages:
        logger.info(
            "waited %.1f s for %d free stages that can build %r; %d are free",
            timeout_s,
            config.total_stages,
            config.model,
            free,
        )


def refusal_note(registry: StageRegistry) -> str:
    """What a planning error adds when stages were refused at registration lately (another
    pipesvc version, see [Note: wire protocol]): their count and the newest reason."""
    refused = registry.refusals()
    if not refused:
        return ""
    return (
        f". {len(refused)} stage(s) were refused at registration in the last "
        f"{REFUSALS_KEPT_S:.0f} s; the latest: {refused[0]}"
    )


@contextlib.contextmanager
def _noting_refusals(registry: StageRegistry) -> Iterator[None]:
    """Inside, a plan that finds too few stages or too little memory adds ``refusal_note``."""
    try:
        yield
    except (PlanError, ResourceExhaustedError) as exc:
        note = refusal_note(registry)
        if not note:
            raise
        raise type(exc)(f"{exc}{note}") from exc


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
                f"{', '.join(known) or 'none (no stages registered)'}{refusal_note(registry)}"
            )
        holders = sorted(
            {r.job_id for r in registry.all() if r.job_id and config.model in r.models}
        )
        raise PlanError(
            f"no free stage can build {config.model!r}; every one that can is serving a job "
            f"({', '.join(holders) or 'none: they are unreachable'}). Free stages by closing a "
            "job: client.jobs() lists them, client.get_job(job_id).close() closes one"
            + refusal_note(registry)
        )
    describer = PipelineStage(start_layer=0, end_layer=0, rank=0, address=candidates[0].address)
    reply = call_stage(
        registry,
        describer,
        lambda stub: stub.Describe,
        stage_pb2.DescribeRequest(
            model=config.model,
            model_args_json=config.model_args_json(),
            input_shape=list(config.input_shape or ()),
            input_dtype=config.input_dtype,
        ),
        timeout_s,
    )
    return list(reply.layers)


def plan_job(
    registry: StageRegistry,
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    job_id: str,
) -> list[PipelineStage]:
    """Partitions the model over free stages (see ``placement.first_plan``) and claims them
    for ``job_id``.

    Raises:
        InvalidArgumentError: more stages than layers.
        PlanError: fewer free stages than ``num_stages``, or they were taken meanwhile.
        ResourceExhaustedError: a stage's share does not fit its memory.
    """
    free = registry.free(config.model)
    with _noting_refusals(registry):
        plan = placement.first_plan(config, layers, free, len(registry.all()))
    if not registry.claim([s.address for s in plan], job_id):
        raise PlanError("stages were taken by another job while planning; try again")
    return plan


def spare_candidates(
    registry: StageRegistry, config: JobConfig, lost: set[str]
) -> list[StageRecord]:
    """Takes the ``lost`` stages out of the registry's pool; returns the free stages that could
    replace them, in registration order (their health is the caller's to check)."""
    for address in lost:
        registry.mark_lost(address)
    return [r for r in registry.free(config.model) if r.address not in lost]


def plan_after_loss(
    registry: StageRegistry,
    config: JobConfig,
    layers: Sequence[stage_pb2.LayerDescription],
    plan: Sequence[PipelineStage],
    lost: set[str],
    job_id: str,
    *,
    candidates: Sequence[StageRecord],
    health: Mapping[str, Health],
) -> list[PipelineStage]:
    """A plan without the ``lost`` stages (see ``placement.replan``), from the
    ``candidates`` of :func:`spare_candidates` and their ``health``; claims and places it.

    Raises:
        PlanError: no stage is left.
        ResourceExhaustedError: the survivors' memory cannot hold the model.
    """
    records = {r.address: r for r in registry.all()}
    with _noting_refusals(registry):
        new_plan = placement.replan(
            config,
            layers,
            plan,
            lost,
            candidates=candidates,
            health=health,
            stages=records,
            job_id=job_id,
        )
    new_plan = keep_link_codecs(plan, new_plan)
    registry.claim([s.address for s in new_plan if records[s.address].job_id != job_id], job_id)
    place(registry, new_plan)
    return new_plan


def keep_link_codecs(
    old: Sequence[PipelineStage], new: Sequence[PipelineStage]
) -> list[PipelineStage]:
    """``new`` with the link codecs ``old`` fixed (``wire_dtype="auto"``, see [Note: automatic
    codecs] in ``pipesvc.core.link_codecs``) at the same (replica, rank, chunk), when the cuts
    did not change: a spare that takes a lost stage's place keeps its links' codecs, so the
    steps replayed after the recovery compute what they computed before. A re-partitioned
    plan starts with the host rule (its boundaries moved, so nothing replays the same)."""
    if [(s.start_layer, s.end_layer) for s in old] != [(s.start_layer, s.end_layer) for s in new]:
        return list(new)
    fixed = {(s.replica, s.rank, s.chunk): s for s in old}
    result = []
    for stage in new:
        before = fixed.get((stage.replica, stage.rank, stage.chunk))
        if before is not None and before.link_codec and not stage.link_codec:
            stage = dataclasses.replace(
                stage, link_codec=before.link_codec, link_reason=before.link_reason
            )
        result.append(stage)
    return result


def place(registry: StageRegistry, plan: Sequence[PipelineStage]) -> None:
    """Records each stage's place in ``plan`` in the registry (its first range)."""
    for stage in servers_of(plan):
        registry.place(
            stage.address, rank=stage.rank, start_layer=stage.start_layer, end_layer=stage.end_layer
        )
