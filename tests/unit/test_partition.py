"""Unit tests for pipesvc.core.planning.partition: coverage, optimality against brute force,
errors."""

from __future__ import annotations

import itertools
import random

import pytest

from pipesvc.core.planning.partition import (
    balanced,
    max_stage_cost,
    partition,
    partition_names,
    uniform,
)
from pipesvc.errors import InvalidArgumentError


def assert_covers(ranges: list[tuple[int, int]], num_layers: int, num_stages: int) -> None:
    """Ranges are contiguous, non-empty, in order and cover [0, num_layers) exactly once."""
    assert len(ranges) == num_stages
    assert ranges[0][0] == 0
    assert ranges[-1][1] == num_layers
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end == start
    assert all(start < end for start, end in ranges)


def all_partitions(num_layers: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """Every way to cut num_layers layers into num_stages non-empty contiguous ranges."""
    result = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = [0, *cuts, num_layers]
        result.append(list(itertools.pairwise(bounds)))
    return result


def test_builtin_partitions_are_registered_in_order() -> None:
    assert partition_names() == ("uniform", "parameters", "memory", "throughput")


@pytest.mark.parametrize("num_layers", range(1, 13))
def test_uniform_sizes(num_layers: int) -> None:
    for num_stages in range(1, num_layers + 1):
        ranges = uniform(num_layers, num_stages)
        assert_covers(ranges, num_layers, num_stages)
        sizes = [end - start for start, end in ranges]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True), "extra layers go to the earliest stages"


def test_uniform_example() -> None:
    assert uniform(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_random_cases_cover_all_layers() -> None:
    rng = random.Random(1234)
    for _ in range(500):
        num_layers = rng.randint(1, 60)
        num_stages = rng.randint(1, num_layers)
        costs = [rng.choice([0, rng.randint(0, 10**6)]) for _ in range(num_layers)]
        for method in partition_names():
            assert_covers(partition(method, costs, num_stages), num_layers, num_stages)


def test_balanced_matches_brute_force_on_all_small_cases() -> None:
    """Optimal bottleneck and the documented tie-break (earliest stages take most layers)."""
    rng = random.Random(7)
    for num_layers in range(1, 9):
        for _ in range(25):
            high = rng.choice([1, 3, 10, 1000])
            costs = [rng.randint(0, high) for _ in range(num_layers)]
            for num_stages in range(1, num_layers + 1):
                got = balanced(costs, num_stages)
                assert_covers(got, num_layers, num_stages)
                candidates = all_partitions(num_layers, num_stages)
                best = min(max_stage_cost(costs, c) for c in candidates)
                assert max_stage_cost(costs, got) == best, (costs, num_stages, got)
                optimal = [c for c in candidates if max_stage_cost(costs, c) == best]
                assert got == max(optimal, key=lambda c: [end for _, end in c])


def test_balanced_examples() -> None:
    assert balanced([1, 1, 1, 1, 4], 2) == [(0, 4), (4, 5)]
    assert balanced([5, 1, 1, 1, 1, 1], 3) == [(0, 1), (1, 5), (5, 6)]
    assert partition("parameters", [10, 10, 10, 10], 2) == [(0, 2), (2, 4)]


def test_zero_costs() -> None:
    assert balanced([0, 0, 0, 0, 0], 3) == [(0, 3), (3, 4), (4, 5)]
    # Zero-cost layers gather on earlier stages without raising the bottleneck.
    assert balanced([0, 0, 7, 0, 0, 7, 0], 2) == [(0, 5), (5, 7)]
    assert max_stage_cost([0, 0, 7, 0, 0, 7, 0], [(0, 5), (5, 7)]) == 7


def test_uniform_method_ignores_cost_values() -> None:
    assert partition("uniform", [100, 0, 0, 0, 0], 2) == [(0, 3), (3, 5)]


def test_too_many_stages_names_both_numbers() -> None:
    with pytest.raises(InvalidArgumentError, match=r"num_stages \(5\) exceeds num_layers \(4\)"):
        partition("uniform", [1, 1, 1, 1], 5)
    with pytest.raises(InvalidArgumentError, match=r"num_stages \(5\) exceeds num_layers \(4\)"):
        partition("parameters", [1, 1, 1, 1], 5)
    with pytest.raises(InvalidArgumentError, match=r"num_stages \(1\) exceeds num_layers \(0\)"):
        balanced([], 1)


@pytest.mark.parametrize("num_stages", [0, -3])
def test_too_few_stages(num_stages: int) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"num_stages \({num_stages}\)"):
        uniform(4, num_stages)
    with pytest.raises(InvalidArgumentError, match=rf"num_stages \({num_stages}\)"):
        balanced([1, 2], num_stages)


def test_unknown_method_lists_choices() -> None:
    known = "uniform, parameters, memory, throughput"
    with pytest.raises(InvalidArgumentError, match=rf"'bytes'.*{known}"):
        partition("bytes", [1, 2, 3], 2)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_costs_name_index_and_value(bad: object) -> None:
    costs: list[object] = [1, 2, bad, 4]
    with pytest.raises(InvalidArgumentError, match=r"costs\[2\]") as info:
        balanced(costs, 2)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_max_stage_cost() -> None:
    assert max_stage_cost([1, 2, 3, 4], [(0, 2), (2, 4)]) == 7
    assert max_stage_cost([1, 2], []) == 0
    with pytest.raises(InvalidArgumentError, match=r"\[1, 5\)"):
        max_stage_cost([1, 2], [(1, 5)])


def _all_cuts(num_layers: int, num_stages: int) -> list[list[tuple[int, int]]]:
    found = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = [0, *cuts, num_layers]
        found.append(list(itertools.pairwise(bounds)))
    return found


@pytest.mark.parametrize("seed", range(30))
def test_fit_capacities_is_optimal_against_brute_force(seed: int) -> None:
    from pipesvc.core.planning.partition import fit_capacities

    rng = random.Random(seed)
    num_layers = rng.randint(1, 8)
    num_stages = rng.randint(1, num_layers)
    costs = [rng.randint(0, 50) for _ in range(num_layers)]
    capacities = [rng.randint(1, 40) for _ in range(num_stages)]
    ranges = fit_capacities(costs, capacities)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(ranges))

    def worst(candidate: list[tuple[int, int]]) -> float:
        return max(sum(costs[s:e]) / c for (s, e), c in zip(candidate, capacities, strict=True))

    best = min(worst(c) for c in _all_cuts(num_layers, num_stages))
    assert worst(ranges) == pytest.approx(best)


def test_fit_capacities_gives_big_budgets_more() -> None:
    from pipesvc.core.planning.partition import fit_capacities

    assert fit_capacities([1] * 8, [1, 3]) == [(0, 2), (2, 8)]
    with pytest.raises(InvalidArgumentError, match="positive"):
        fit_capacities([1, 2], [1, 0])


@pytest.mark.parametrize("seed", range(30))
def test_fit_capacities_with_per_rank_copies_is_optimal_against_brute_force(seed: int) -> None:
    """Activations: each rank holds ``copies[rank]`` micro-batches of its layers' per-copy cost."""
    from pipesvc.core.planning.partition import fit_capacities

    rng = random.Random(1000 + seed)
    num_layers = rng.randint(1, 8)
    num_stages = rng.randint(1, num_layers)
    costs = [rng.randint(0, 50) for _ in range(num_layers)]
    per_copy = [rng.randint(0, 20) for _ in range(num_layers)]
    copies = [rng.randint(0, 4) for _ in range(num_stages)]
    capacities = [rng.randint(1, 40) for _ in range(num_stages)]
    ranges = fit_capacities(costs, capacities, per_copy=per_copy, copies=copies)

    def worst(candidate: list[tuple[int, int]]) -> float:
        return max(
            (sum(costs[s:e]) + n * sum(per_copy[s:e])) / c
            for (s, e), c, n in zip(candidate, capacities, copies, strict=True)
        )

    best = min(worst(c) for c in _all_cuts(num_layers, num_stages))
    assert worst(ranges) == pytest.approx(best)


def test_fit_capacities_moves_layers_off_ranks_that_hold_more_activations() -> None:
    from pipesvc.core.planning.partition import fit_capacities

    # Equal weights and budgets; rank 0 holds 4 micro-batches in flight, rank 1 one (1F1B).
    assert fit_capacities([10] * 6, [100, 100]) == [(0, 3), (3, 6)]
    assert fit_capacities([10] * 6, [100, 100], per_copy=[5] * 6, copies=[4, 1]) == [
        (0, 2),
        (2, 6),
    ]
    with pytest.raises(InvalidArgumentError, match="one entry per layer"):
        fit_capacities([1, 2], [1, 1], per_copy=[1], copies=[1, 1])
