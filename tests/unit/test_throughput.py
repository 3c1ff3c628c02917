"""The throughput partition against brute force, and where it puts the work."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from pipesvc.core.planning import throughput
from pipesvc.core.planning.throughput import LayerCosts, StageRate
from pipesvc.errors import InvalidArgumentError, ResourceExhaustedError


def _brute_force(
    costs: LayerCosts,
    candidates: list[StageRate],
    num_stages: int,
    need: throughput.MemoryNeed | None,
) -> float:
    """The smallest bottleneck over every ordered choice of stages and every set of cuts."""
    num_layers = len(costs.work)
    best = math.inf
    for chosen in itertools.permutations(range(len(candidates)), num_stages):
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
            bounds = [0, *cuts, num_layers]
            ranges = list(itertools.pairwise(bounds))
            if need is not None and any(
                need(s, e, r) > candidates[c].memory_bytes
                for r, ((s, e), c) in enumerate(zip(ranges, chosen, strict=True))
            ):
                continue
            seconds = throughput.predict(costs, [candidates[c] for c in chosen], ranges)
            best = min(best, max(seconds))
    return best


def _random_case(rng: random.Random) -> tuple[LayerCosts, list[StageRate], int]:
    num_layers = rng.randint(2, 7)
    work = [rng.choice([0.0, rng.uniform(0.1, 5.0)]) for _ in range(num_layers)]
    boundary = [rng.randint(0, 4000) for _ in range(num_layers)]
    candidates = [
        StageRate(
            speed=rng.choice([0.25, 1.0, rng.uniform(0.2, 3.0)]),
            memory_bytes=rng.randint(3, 12),
            link_bytes_per_s=rng.choice([math.inf, rng.uniform(500, 5000)]),
            link_latency_s=rng.choice([0.0, 0.01]),
        )
        for _ in range(rng.randint(1, 5))
    ]
    num_stages = rng.randint(1, min(num_layers, len(candidates)))
    return LayerCosts(work, boundary), candidates, num_stages


@pytest.mark.parametrize("seed", range(150))
def test_the_plan_is_as_fast_as_the_best_of_every_placement_and_cut(seed: int) -> None:
    rng = random.Random(seed)
    costs, candidates, num_stages = _random_case(rng)
    weights = [rng.randint(1, 4) for _ in costs.work]

    def need(start: int, end: int, rank: int) -> int:
        return sum(weights[start:end]) + rank  # later ranks hold a little more

    expected = _brute_force(costs, candidates, num_stages, need)
    if math.isinf(expected):
        with pytest.raises(ResourceExhaustedError, match="within their memory"):
            throughput.plan(costs, candidates, num_stages, need)
        return
    result = throughput.plan(costs, candidates, num_stages, need)
    assert result.bottleneck_s == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert len(set(result.stages)) == num_stages
    assert result.ranges[0][0] == 0 and result.ranges[-1][1] == len(costs.work)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(result.ranges))
    for rank, ((start, end), stage) in enumerate(zip(result.ranges, result.stages, strict=True)):
        assert need(start, end, rank) <= candidates[stage].memory_bytes
    predicted = throughput.predict(costs, [candidates[s] for s in result.stages], result.ranges)
    assert result.stage_seconds == predicted


def test_a_slow_stage_gets_less_work_or_none() -> None:
    """Four equal layers' worth of blocks on stages where the second runs at a quarter speed."""
    costs = LayerCosts(work=[1.0] * 12, boundary_bytes=[0] * 12)
    rates = [StageRate(1.0, 1 << 30), StageRate(0.25, 1 << 30)] + [StageRate(1.0, 1 << 30)] * 2
    spread = throughput.plan(costs, rates, 4)
    sizes = {
        stage: end - start for (start, end), stage in zip(spread.ranges, spread.stages, strict=True)
    }
    assert sizes[1] == 1 and sorted(sizes[s] for s in (0, 2, 3)) == [3, 4, 4]
    assert spread.bottleneck_s == 4.0  # against 12 / 4 / 0.25 = 12 s for equal thirds
    # With a spare as fast as the others, the slow stage is left out.
    chosen = throughput.plan(costs, [*rates, StageRate(1.0, 1 << 30)], 4)
    assert 1 not in chosen.stages and chosen.bottleneck_s == 3.0


def test_a_slow_link_moves_the_cut_to_a_small_boundary() -> None:
    """Two stages: cutting after a layer with a large output costs its transfer both ways."""
    costs = LayerCosts(work=[1.0, 1.0, 1.0, 1.0], boundary_bytes=[10, 1_000_000, 10, 10])
    rates = [StageRate(1.0, 1 << 30, link_bytes_per_s=1e6)] * 2
    result = throughput.plan(costs, rates, 2)
    assert result.ranges != [(0, 2), (2, 4)]  # 2 s of compute plus 2 s on the link
    assert result.bottleneck_s == pytest.approx(3.0, abs=1e-4)


def test_a_stage_without_memory_for_any_share_is_not_used() -> None:
    costs = LayerCosts(work=[1.0] * 4, boundary_bytes=[0] * 4)
    rates = [StageRate(10.0, 0), StageRate(1.0, 100), StageRate(1.0, 100)]
    result = throughput.plan(costs, rates, 2, lambda s, e, r: 10 * (e - s))
    assert sorted(result.stages) == [1, 2]


@pytest.mark.parametrize(
    ("work", "rates", "num_stages", "match"),
    [
        ([1.0], [StageRate(1.0, 1)], 2, "num_stages must be between 1 and"),
        ([1.0, -1.0], [StageRate(1.0, 1)], 1, "layer 1's work must be finite"),
        ([1.0], [StageRate(0.0, 1)], 1, "stage 0's speed must be finite and > 0"),
        ([1.0], [StageRate(1.0, 1, link_bytes_per_s=0.0)], 1, "stage 0's link"),
    ],
)
def test_bad_numbers_are_refused(
    work: list[float], rates: list[StageRate], num_stages: int, match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        throughput.plan(LayerCosts(work, [0] * len(work)), rates, num_stages)


@pytest.mark.parametrize("seed", range(60))
def test_links_counted_in_their_codecs_keep_the_plan_exact(seed: int) -> None:
    """A candidate's ``wire_fraction`` (its link's codec, see [Note: automatic codecs]) scales
    its link's bytes, in the search as in ``predict``."""
    rng = random.Random(1000 + seed)
    costs, candidates, num_stages = _random_case(rng)
    candidates = [
        dataclasses.replace(c, wire_fraction=rng.choice([1.0, 0.5, 0.3828125])) for c in candidates
    ]
    expected = _brute_force(costs, candidates, num_stages, None)
    result = throughput.plan(costs, candidates, num_stages)
    assert result.bottleneck_s == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_a_compressed_link_costs_its_codecs_bytes() -> None:
    costs = LayerCosts(work=[1.0, 1.0], boundary_bytes=[1000, 8])
    exact = StageRate(speed=1.0, memory_bytes=10, link_bytes_per_s=100.0)
    int8 = dataclasses.replace(exact, wire_fraction=0.25)
    # Layer 0's output both ways: 2 x 1000 B at 100 B/s, or a quarter of it.
    assert throughput.predict(costs, [exact, exact], [(0, 1), (1, 2)]) == [21.0, 1.0]
    assert throughput.predict(costs, [int8, exact], [(0, 1), (1, 2)]) == [6.0, 1.0]
    assert throughput.plan(costs, [int8, exact], 2).stage_seconds == [6.0, 1.0]
    with pytest.raises(InvalidArgumentError, match="wire_fraction must be finite and > 0"):
        throughput.plan(costs, [dataclasses.replace(exact, wire_fraction=0.0), exact], 2)
