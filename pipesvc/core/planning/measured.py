"""What a measurement of a job's stages says, and what it decides, pure (no I/O): layer costs
and stage speeds from the stages' profiles, link rates from the probes, which pairs of hosts to
probe, and the codecs of each link under ``wire_dtype="auto"`` (see [Note: automatic codecs]
in ``pipesvc.core.link_codecs``). The coordinator's re-planner (``coordinator/rebalance.py``)
asks the stages and applies what this decides."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pipesvc.core.config import JobConfig
from pipesvc.core.job_sections import WIRE_AUTO
from pipesvc.core.link_codecs import (
    Codecs,
    Link,
    LinkMeasure,
    choose_auto,
    crosses_hosts,
    host_of,
    link_codec_text,
    links,
    wire_fraction,
)
from pipesvc.core.plan import PipelineStage
from pipesvc.core.planning import throughput
from pipesvc.core.planning.placement import Stage
from pipesvc.errors import FailedPreconditionError
from pipesvc.v1 import stage_pb2

MAX_PROBES = 16
"""Pairs of hosts one measurement probes at most (each costs up to about half a second)."""


@dataclass(frozen=True, slots=True)
class Measurements:
    """One measurement of a job: the model's layer costs per micro-batch, and every candidate
    stage's rate (the job's stages first, in rank order, then the free stages)."""

    costs: throughput.LayerCosts
    stages: Sequence[Stage]
    rates: list[throughput.StageRate]
    current_s: list[float]
    """The current plan's predicted seconds per micro-batch, per rank."""
    link_rates: dict[frozenset[str], float] = dataclasses.field(default_factory=dict)
    """The probed rate of links between hosts (see [Note: link probe] in
    ``pipesvc.stage.net.probe``), by the pair of hosts they join (either way: a link's two
    directions are taken to have the same rate): the current plan's links and the other pairs
    of the candidates' hosts; what ``wire_dtype="auto"`` decides by."""


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
    based_on: list[PipelineStage]
    """The plan the decision was made on (a recovery since makes it stale)."""


def probe_pairs(plan: list[PipelineStage], stages: Sequence[Stage]) -> list[tuple[str, str]]:
    """The (sender, receiver) stage addresses whose links a measurement probes: each link of
    ``plan`` between hosts, then one pair of stages for every other pair of hosts among
    ``stages`` (the candidates a throughput plan may chain), at most ``MAX_PROBES``; each pair
    of hosts once (a link's rate is taken to be the same both ways)."""
    pairs: list[tuple[str, str]] = []
    seen: set[frozenset[str]] = set()
    ordered = sorted((s for s in plan if s.chunk == 0 and s.replica == 0), key=lambda s: s.rank)
    candidates = [(a.address, b.address) for a, b in itertools.pairwise(ordered)]
    first_on: dict[str, str] = {}
    for record in stages:
        first_on.setdefault(host_of(record.address), record.address)
    candidates += list(itertools.combinations(first_on.values(), 2))
    for a, b in candidates:
        pair = link_hosts(a, b)
        if len(pair) == 2 and pair not in seen and len(pairs) < MAX_PROBES:
            seen.add(pair)
            pairs.append((a, b))
    return pairs


def measurements(
    plan: list[PipelineStage],
    num_layers: int,
    stages: Sequence[Stage],
    profiles: list[stage_pb2.StageProfile],
    probed: dict[frozenset[str], float] | None = None,
) -> Measurements:
    """Layer costs and stage speeds from the job's stages' timings (see [Note: measured
    speed]), and link rates from ``probed`` (by pair of hosts, see [Note: link probe] in
    ``pipesvc.stage.net.probe``): a stage's link is the probed rate of its link to the next stage
    where that was probed, else the rate of its own send calls (a link on one host)."""
    probed = probed or {}
    times: dict[int, float] = {}
    boundary: dict[int, int] = {}
    speeds: list[float | None] = []
    for stage, profile in zip(plan, profiles, strict=False):
        flops = forward_s = 0.0
        for layer in profile.layers:
            if stage.start_layer <= layer.index < stage.end_layer:
                times[layer.index] = layer.forward_s + layer.backward_s
                boundary[layer.index] = layer.output_bytes
                if layer.flops > 0:  # a layer without counted operations says nothing of speed
                    flops += layer.flops
                    forward_s += layer.forward_s
        speeds.append(flops / forward_s if flops > 0 and forward_s > 0 else None)
    missing = [i for i in range(num_layers) if i not in times]
    if missing:
        raise FailedPreconditionError(
            f"layer {missing[0]} has no timings on its stage yet; train a step on this plan "
            "before planning for throughput"
        )
    # Calibrated speeds in the units of the measured ones, for the stages without a measured
    # speed (free stages; a job's stage whose layers count no operations).
    ratios = [
        s / p.speed for s, p in zip(speeds, profiles, strict=False) if s is not None and p.speed > 0
    ]
    scale = statistics.median(ratios) if ratios else 1.0
    speeds += [None] * (len(stages) - len(speeds))
    speed = [
        s if s is not None else max(p.speed * scale, 1e-9)
        for s, p in zip(speeds, profiles, strict=True)
    ]
    own_link = [
        probed.get(link_hosts(a.address, b.address), 0.0) or profile.send_bytes_per_s
        for a, b, profile in zip(plan, plan[1:], profiles, strict=False)
    ]
    known = [rate for rate in own_link if rate > 0]
    default_rate = statistics.median(known) if known else float("inf")
    own_link += [0.0] * (len(stages) - len(own_link))
    rates = [
        throughput.StageRate(
            speed=v, memory_bytes=record.memory_bytes, link_bytes_per_s=link or default_rate
        )
        for record, link, v in zip(stages, own_link, speed, strict=True)
    ]
    holder = {i: r for r, s in enumerate(plan) for i in range(s.start_layer, s.end_layer)}
    costs = throughput.LayerCosts(
        work=[times[i] * speed[holder[i]] for i in range(num_layers)],
        boundary_bytes=[boundary[i] for i in range(num_layers)],
    )
    ranges = [(s.start_layer, s.end_layer) for s in plan]
    current_s = throughput.predict(costs, rates[: len(plan)], ranges)
    link_rates = {pair: rate for pair, rate in probed.items() if len(pair) == 2}
    return Measurements(costs, stages, rates, current_s, link_rates)


def link_hosts(a: str, b: str) -> frozenset[str]:
    """The hosts a link between the stages at addresses ``a`` and ``b`` joins."""
    return frozenset((host_of(a), host_of(b)))


def decide_links(
    config: JobConfig, plan: list[PipelineStage], measured: Measurements
) -> list[PipelineStage]:
    """``plan`` (one pipeline, chunk 0 only) with each link's codecs and the reason fixed by
    the rule of [Note: automatic codecs] in ``pipesvc.core.link_codecs``, from ``measured``:
    a link's rate is the one measured between its two hosts (in either direction: a plan that
    reverses two stages still knows their link), and each stage's compute is its range's work
    at its speed."""
    index = {record.address: i for i, record in enumerate(measured.stages)}
    costs = measured.costs
    compute = [
        throughput.stage_seconds(
            costs, measured.rates[index[s.address]], s.start_layer, s.end_layer, last=True
        )
        for s in plan
    ]
    decided = []
    for rank, stage in enumerate(plan):
        if rank == len(plan) - 1:
            decided.append(dataclasses.replace(stage, link_codec="", link_reason=""))
            continue
        after = plan[rank + 1].address
        codecs, why = choose_auto(
            LinkMeasure(
                between_hosts=crosses_hosts(stage.address, after),
                boundary_bytes=costs.boundary_bytes[stage.end_layer - 1],
                link_bytes_per_s=measured.link_rates.get(link_hosts(stage.address, after)),
                compute_s=(compute[rank], compute[rank + 1]),
                compressed=bool(stage.link_codec),
            )
        )
        decided.append(
            dataclasses.replace(stage, link_codec=link_codec_text(codecs), link_reason=why)
        )
    return decided


def codecs_of(config: JobConfig, plan: list[PipelineStage]) -> list[Codecs]:
    """What each link of ``plan`` sends in, in rank order."""
    return [link.codecs for link in links(config, plan)]


def decides_links(config: JobConfig) -> bool:
    """Whether a measurement of ``config``'s job decides its links' codecs: under
    ``wire_dtype="auto"``, for a job of one pipeline with one range per stage (the jobs a
    re-plan moves)."""
    return (
        config.wire_dtype == WIRE_AUTO and config.data_parallel == 1 and config.virtual_stages == 1
    )


def exact_itemsize(config: JobConfig) -> int:
    """Bytes of one exact activation value under ``config``'s precision."""
    return 4 if config.precision == "fp32" else 2


def with_codecs(
    config: JobConfig,
    measured: Measurements,
    plan: list[PipelineStage],
    chosen: list[Link],
) -> list[throughput.StageRate]:
    """The rates of ``plan``'s stages in rank order, each link counted in its codecs."""
    index = {record.address: i for i, record in enumerate(measured.stages)}
    codecs: dict[int, Codecs] = {link.source: link.codecs for link in chosen}
    itemsize = exact_itemsize(config)
    return [
        dataclasses.replace(
            measured.rates[index[s.address]],
            wire_fraction=wire_fraction(codecs.get(rank, (None, None)), itemsize),
        )
        for rank, s in enumerate(plan)
    ]


def operations(profile: stage_pb2.StageProfile) -> int:
    return sum(layer.flops for layer in profile.layers)


def report(
    measured: Measurements,
    current: list[PipelineStage],
    chosen: list[PipelineStage],
    chosen_s: list[float],
) -> str:
    """A table of the candidates: speed, link rate, and their place and time per micro-batch
    in the current and the chosen plan."""

    def place(plan: list[PipelineStage], seconds: list[float], address: str) -> str:
        for stage, s in zip(plan, seconds, strict=True):
            if stage.address == address:
                return f"[{stage.start_layer}, {stage.end_layer}) {1e3 * s:.2f} ms"
        return "-"

    lines = [f"{'stage':<22} {'GFLOP/s':>8} {'link MB/s':>10}  {'now':<22} {'planned':<22}"]
    for record, rate in zip(measured.stages, measured.rates, strict=True):
        link = (
            "-" if rate.link_bytes_per_s == float("inf") else f"{rate.link_bytes_per_s / 1e6:.0f}"
        )
        lines.append(
            f"{record.address:<22} {rate.speed / 1e9:8.2f} {link:>10}  "
            f"{place(current, measured.current_s, record.address):<22} "
            f"{place(chosen, chosen_s, record.address):<22}"
        )
    return "\n".join(lines)
