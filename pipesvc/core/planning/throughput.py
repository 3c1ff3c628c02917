"""The ``throughput`` partition: ranges and their stages chosen for the fastest pipelined step.

No gRPC here: the inputs are numbers the coordinator measured (see ``coordinator/profile.py``).

[Note: throughput plan] In every schedule pipesvc runs, the steady state of a step moves at
the pace of its slowest stage: each micro-batch passes every stage once forward and once
backward, and a stage cannot start the next before it finishes the last. A stage's time per
micro-batch is the work of its layers at its own speed, plus sending its last layer's output
forward and receiving the gradient of that output back over its link to the next stage. The
plan minimises the largest of these times (the bottleneck), subject to every stage's memory:

    time(stage s, layers [i, j)) = sum(work[i:j]) / speed[s]
                                   + 2 * (boundary_bytes[j - 1] * wire_fraction[s]
                                          / link_bytes_per_s[s] + latency[s])
                                   (the transfer only where j is not the last layer)

``wire_fraction`` counts the link's bytes in its codec: the bytes it sends per byte of
``boundary_bytes``, averaged over the activation forward and the gradient back (1 when the
boundary bytes are what crosses; under ``wire_dtype="auto"`` the re-planner gives a link that
would be compressed the fraction of its codecs, see [Note: automatic codecs] in
``pipesvc.core.link_codecs``).

Which stage gets which range matters as much as where the cuts are when stages differ, so the
search covers both: a dynamic program over (the set of stages used so far, the layers covered
so far), choosing ``num_stages`` of the candidate stages, their order and the cuts. It is exact
(tests check it against brute force), in O(2^n * n * L^2) for n candidates and L layers;
beyond ``MAX_EXACT_CANDIDATES`` candidates it considers only that many of the fastest.
Ties go to the plan that keeps the candidates' given order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipesvc.errors import InvalidArgumentError, ResourceExhaustedError

MAX_EXACT_CANDIDATES = 10
"""The most candidate stages searched over exactly (2^n subsets)."""


@dataclass(frozen=True, slots=True)
class StageRate:
    """What the plan knows of one candidate stage."""

    speed: float
    """Work per second (work in the units of ``LayerCosts.work``; relative speeds suffice)."""
    memory_bytes: int
    link_bytes_per_s: float = math.inf
    """Its link to whichever stage follows it (inf: free)."""
    link_latency_s: float = 0.0
    wire_fraction: float = 1.0
    """Bytes its link sends per byte of a boundary's ``boundary_bytes`` (its codec)."""


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """What the plan knows of the model's layers, per micro-batch."""

    work: Sequence[float]
    """Forward and backward work of each layer (seconds on a stage of speed 1)."""
    boundary_bytes: Sequence[int]
    """Bytes of each layer's output (what crosses a link if a range ends there)."""


MemoryNeed = Callable[[int, int, int], int]
"""Bytes a stage needs to hold layers [start, end) at rank ``rank``: (start, end, rank)."""


@dataclass(frozen=True, slots=True)
class ThroughputPlan:
    """Ranges in rank order, the candidate index of the stage holding each, and the predicted
    seconds per micro-batch of each stage (their maximum is the bottleneck)."""

    ranges: list[tuple[int, int]]
    stages: list[int]
    stage_seconds: list[float]

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_seconds)


def stage_seconds(costs: LayerCosts, rate: StageRate, start: int, end: int, *, last: bool) -> float:
    """Seconds per micro-batch of a stage at ``rate`` holding layers [start, end)."""
    seconds = sum(costs.work[start:end]) / rate.speed
    if not last:
        seconds += 2 * (
            costs.boundary_bytes[end - 1] * rate.wire_fraction / rate.link_bytes_per_s
            + rate.link_latency_s
        )
    return seconds


def predict(
    costs: LayerCosts, rates: Sequence[StageRate], ranges: Sequence[tuple[int, int]]
) -> list[float]:
    """Each stage's seconds per micro-batch when ``rates[r]`` holds ``ranges[r]``."""
    return [
        stage_seconds(costs, rate, start, end, last=r == len(ranges) - 1)
        for r, (rate, (start, end)) in enumerate(zip(rates, ranges, strict=True))
    ]


def plan(
    costs: LayerCosts,
    candidates: Sequence[StageRate],
    num_stages: int,
    need: MemoryNeed | None = None,
) -> ThroughputPlan:
    """The plan with the smallest bottleneck (see [Note: throughput plan]): ``num_stages`` of
    ``candidates``, in the order they take the ranges, and the ranges.

    Raises:
        InvalidArgumentError: ``num_stages`` is below 1 or above the layers or candidates, or
            a cost or rate is negative, not finite or zero where it divides.
        ResourceExhaustedError: no plan fits every chosen stage's memory.
    """
    num_layers = len(costs.work)
    _check(costs, candidates, num_stages)
    order = sorted(range(len(candidates)), key=lambda c: -candidates[c].speed)
    kept = sorted(order[:MAX_EXACT_CANDIDATES])  # the fastest, in their given order
    prefix = [0.0, *accumulate(float(w) for w in costs.work)]
    n = len(kept)
    # best[mask][i]: the smallest bottleneck covering layers [0, i) with the stages in mask
    # (its bit count is the number of ranks used); parent[mask][i] = (previous mask, start).
    best: list[dict[int, float]] = [{} for _ in range(1 << n)]
    parent: dict[tuple[int, int], tuple[int, int, int]] = {}
    best[0][0] = 0.0
    for mask in sorted(range(1 << n), key=lambda m: m.bit_count()):
        rank = mask.bit_count()
        if rank >= num_stages or not best[mask]:
            continue
        remaining = num_stages - rank - 1  # ranks after this one, one layer each at least
        last = remaining == 0
        for start, so_far in sorted(best[mask].items()):
            ends = [num_layers] if last else range(start + 1, num_layers - remaining + 1)
            for slot in range(n):
                bit = 1 << slot
                if mask & bit:
                    continue
                rate = candidates[kept[slot]]
                for end in ends:
                    if end <= start:
                        continue
                    if need is not None and need(start, end, rank) > rate.memory_bytes:
                        continue
                    seconds = (prefix[end] - prefix[start]) / rate.speed
                    if not last:
                        seconds += 2 * (
                            costs.boundary_bytes[end - 1]
                            * rate.wire_fraction
                            / rate.link_bytes_per_s
                            + rate.link_latency_s
                        )
                    value = max(so_far, seconds)
                    target = best[mask | bit]
                    if value < target.get(end, math.inf):
                        target[end] = value
                        parent[(mask | bit, end)] = (mask, start, slot)
    finals = [
        (value, mask)
        for mask in range(1 << n)
        if mask.bit_count() == num_stages
        for value in [best[mask].get(num_layers)]
        if value is not None
    ]
    if not finals:
        raise ResourceExhaustedError(
            f"no {num_stages} of the {len(candidates)} stages can hold the model's "
            f"{num_layers} layers within their memory"
        )
    _, mask = min(finals, key=lambda f: (f[0], _order_key(f[1], n)))
    ranges: list[tuple[int, int]] = []
    stages: list[int] = []
    end = num_layers
    while mask:
        previous, start, slot = parent[(mask, end)]
        ranges.append((start, end))
        stages.append(kept[slot])
        mask, end = previous, start
    ranges.reverse()
    stages.reverse()
    return ThroughputPlan(ranges, stages, predict(costs, [candidates[s] for s in stages], ranges))


def _order_key(mask: int, n: int) -> list[int]:
    """Prefers the earlier candidates among equally fast plans."""
    return [slot for slot in range(n) if mask & (1 << slot)]


def _check(costs: LayerCosts, candidates: Sequence[StageRate], num_stages: int) -> None:
    num_layers = len(costs.work)
    if len(costs.boundary_bytes) != num_layers:
        raise InvalidArgumentError(
            f"boundary_bytes has {len(costs.boundary_bytes)} entries; expected one per layer "
            f"({num_layers})"
        )
    if not 1 <= num_stages <= min(num_layers, len(candidates)):
        raise InvalidArgumentError(
            f"num_stages must be between 1 and min(layers, candidate stages) = "
            f"{min(num_layers, len(candidates))}; got {num_stages}"
        )
    if num_stages > MAX_EXACT_CANDIDATES:
        raise InvalidArgumentError(
            f"the throughput plan searches at most {MAX_EXACT_CANDIDATES} stages exactly; "
            f"got num_stages {num_stages} (use the parameters or memory partition)"
        )
    for index, work in enumerate(costs.work):
        if not (math.isfinite(work) and work >= 0):
            raise InvalidArgumentError(f"layer {index}'s work must be finite and >= 0; got {work}")
    for index, rate in enumerate(candidates):
        if not (math.isfinite(rate.speed) and rate.speed > 0):
            raise InvalidArgumentError(
                f"stage {index}'s speed must be finite and > 0; got {rate.speed}"
            )
        if not rate.link_bytes_per_s > 0 or rate.link_latency_s < 0:
            raise InvalidArgumentError(
                f"stage {index}'s link must have a rate > 0 and a latency >= 0; got "
                f"{rate.link_bytes_per_s} B/s, {rate.link_latency_s} s"
            )
        if not (math.isfinite(rate.wire_fraction) and rate.wire_fraction > 0):
            raise InvalidArgumentError(
                f"stage {index}'s wire_fraction must be finite and > 0; got {rate.wire_fraction}"
            )
