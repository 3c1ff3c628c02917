"""Splitting a model's layers into contiguous per-stage ranges (the planner's pure core).

[Note: partition registry] A partition method is a name mapped (:func:`register_partition`) to
a function ``(costs, num_stages) -> ranges``. The job configuration's check, the docs and the
planner's :func:`partition` all ask the registry, so a registered method is valid everywhere the
coordinator runs (stages never partition). ``memory`` with unequal budgets is the exception the
planner handles itself: it needs the stages' budgets, so it calls :func:`fit_capacities`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from pipesvc.errors import InternalError, InvalidArgumentError
from pipesvc.name_registry import Registry

__all__ = [
    "PARTITION_NAME_PATTERN",
    "PartitionFn",
    "balanced",
    "fit_capacities",
    "get_partition",
    "max_stage_cost",
    "partition",
    "partition_names",
    "register_partition",
    "uniform",
]

PartitionFn = Callable[[Sequence[int], int], list[tuple[int, int]]]
"""A partition method: per-layer costs and a stage count to half-open ranges in rank order."""

_PartitionT = TypeVar("_PartitionT", bound=PartitionFn)

PARTITION_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
"""Partition method names: lowercase letters, digits, ``_`` and ``-``."""

_PARTITIONS: Registry[PartitionFn] = Registry("partition", PARTITION_NAME_PATTERN)


def register_partition(name: str) -> Callable[[_PartitionT], _PartitionT]:
    """Returns a decorator that registers a partition function under ``name``.

    Raises:
        InvalidArgumentError: ``name`` does not match :data:`PARTITION_NAME_PATTERN`, or is
            already registered to a different function.
    """
    _PARTITIONS.check_name(name)

    def decorator(method: _PartitionT) -> _PartitionT:
        _PARTITIONS.register(name, method)
        return method

    return decorator


def partition_names() -> tuple[str, ...]:
    """Returns the registered partition method names, in registration order."""
    return _PARTITIONS.names()


def _unknown_method(name: object, known: tuple[str, ...]) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"unknown partition method {name!r}; expected one of {', '.join(known)}"
    )


def get_partition(name: str) -> PartitionFn:
    """Returns the partition function registered under ``name``.

    Raises:
        InvalidArgumentError: ``name`` is not registered; the message lists the known names.
    """
    return _PARTITIONS.get(name, _unknown_method)


def _check_counts(num_layers: int, num_stages: int) -> None:
    """Checks that ``num_stages`` stages of at least one layer each can cover ``num_layers``.

    Raises:
        InvalidArgumentError: If either number is not an int, ``num_stages`` is below 1 or
            ``num_stages`` exceeds ``num_layers``.
    """
    for name, value in (("num_layers", num_layers), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{name} ({value!r}) must be an int")
    if num_stages < 1:
        raise InvalidArgumentError(f"num_stages ({num_stages}) must be at least 1")
    if num_stages > num_layers:
        raise InvalidArgumentError(
            f"num_stages ({num_stages}) exceeds num_layers ({num_layers}); "
            "every stage needs at least one layer"
        )


def _check_costs(costs: Sequence[int]) -> None:
    """Checks that every cost is a non-negative int.

    Raises:
        InvalidArgumentError: Naming the first offending index and value.
    """
    for index, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
            raise InvalidArgumentError(f"costs[{index}] ({cost!r}) must be a non-negative int")


def uniform(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Splits ``num_layers`` layers into ``num_stages`` ranges of near-equal layer count.

    Sizes differ by at most one; the extra layers go to the earliest stages.

    Args:
        num_layers: Number of layers in the model.
        num_stages: Number of stages (ranges) to produce.

    Returns:
        Half-open ``(start_layer, end_layer)`` ranges in rank order, covering every layer once.

    Raises:
        InvalidArgumentError: If ``num_stages`` is below 1 or exceeds ``num_layers``.
    """
    _check_counts(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    ranges: list[tuple[int, int]] = []
    start = 0
    for rank in range(num_stages):
        end = start + base + (1 if rank < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _min_parts(costs: Sequence[int], bound: int) -> int:
    """Returns the fewest contiguous parts with sums at most ``bound`` (``bound >= max(costs)``)."""
    parts = 1
    total = 0
    for cost in costs:
        if total + cost > bound:
            parts += 1
            total = cost
        else:
            total += cost
    return parts


def balanced(costs: Sequence[int], num_stages: int) -> list[tuple[int, int]]:
    """Splits layers into contiguous ranges minimising the largest per-stage total cost.

    The result is optimal: a binary search finds the smallest bound ``B`` for which the layers
    fit into ``num_stages`` parts of total cost at most ``B`` (any count of parts between the
    greedy minimum and the number of layers is reachable, because costs are non-negative), then
    the ranges are built greedily.

    Tie-break: among all optimal partitions this returns the one whose earlier stages take as
    many layers as possible (the lexicographically largest sequence of end layers). Each stage
    takes the longest prefix that stays within ``B`` and leaves at least one layer for every
    later stage; zero-cost layers therefore gather on the earlier stages, as in :func:`uniform`.

    Args:
        costs: Per-layer cost (e.g. parameter count), non-negative ints.
        num_stages: Number of stages (ranges) to produce.

    Returns:
        Half-open ``(start_layer, end_layer)`` ranges in rank order, each at least one layer.

    Raises:
        InvalidArgumentError: If a cost is negative or not an int, or ``num_stages`` is below 1
            or exceeds the number of layers.
    """
    _check_counts(len(costs), num_stages)
    _check_costs(costs)
    low, high = max(costs), sum(costs)
    while low < high:
        middle = (low + high) // 2
        if _min_parts(costs, middle) <= num_stages:
            high = middle
        else:
            low = middle + 1
    bound = low

    num_layers = len(costs)
    ranges: list[tuple[int, int]] = []
    start = 0
    for rank in range(num_stages):
        later_stages = num_stages - rank - 1
        end = start + 1
        total = costs[start]
        while end < num_layers - later_stages and total + costs[end] <= bound:
            total += costs[end]
            end += 1
        ranges.append((start, end))
        start = end
    # Invariant of the greedy construction (see the docstring): the last stage ends at the end.
    assert start == num_layers, (start, num_layers)
    return ranges


def fit_capacities(
    costs: Sequence[int],
    capacities: Sequence[int],
    *,
    per_copy: Sequence[int] | None = None,
    copies: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """Contiguous ranges, one per capacity in order, minimising the largest cost / capacity.

    A stage's cost is the sum of its layers' ``costs`` plus, when given, ``copies[rank]`` times
    the sum of their ``per_copy`` costs (the ``memory`` partition: weights, gradients and
    optimizer state, plus the activations of each micro-batch the schedule keeps in flight on
    that rank). Exact (dynamic programming over cut points, O(stages x layers^2)).

    Raises:
        InvalidArgumentError: more stages than layers, a capacity that is not positive, or
            ``per_copy`` and ``copies`` of the wrong lengths.
    """
    num_layers, num_stages = len(costs), len(capacities)
    _check_counts(num_layers, num_stages)
    if any(c <= 0 for c in capacities):
        raise InvalidArgumentError(f"capacities {list(capacities)} must all be positive")
    extra = list(per_copy) if per_copy is not None else [0] * num_layers
    factors = list(copies) if copies is not None else [0] * num_stages
    if len(extra) != num_layers or len(factors) != num_stages:
        raise InvalidArgumentError(
            f"per_copy ({len(extra)}) must have one entry per layer ({num_layers}) and copies "
            f"({len(factors)}) one per stage ({num_stages})"
        )
    prefix, extra_prefix = [0], [0]
    for cost, more in zip(costs, extra, strict=True):
        prefix.append(prefix[-1] + cost)
        extra_prefix.append(extra_prefix[-1] + more)
    inf = float("inf")
    # best[j][i]: the least worst ratio placing layers [0, i) on the first j stages.
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        capacity, factor = capacities[j - 1], factors[j - 1]
        for i in range(j, num_layers - (num_stages - j) + 1):
            for k in range(j - 1, i):
                cost = prefix[i] - prefix[k] + factor * (extra_prefix[i] - extra_prefix[k])
                worst = max(best[j - 1][k], cost / capacity)
                if worst < best[j][i]:
                    best[j][i], cut[j][i] = worst, k
    ranges = []
    end = num_layers
    for j in range(num_stages, 0, -1):
        start = cut[j][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def partition(method: str, costs: Sequence[int], num_stages: int) -> list[tuple[int, int]]:
    """Splits layers into ``num_stages`` contiguous ranges with the named method.

    Args:
        method: A registered name (:func:`partition_names`). ``"parameters"`` balances
            ``costs`` with :func:`balanced`; ``"uniform"`` uses only ``len(costs)`` (see
            :func:`uniform`); ``"memory"`` with equal budgets is :func:`balanced` too.
        costs: Per-layer cost, one entry per layer.
        num_stages: Number of stages (ranges) to produce.

    Returns:
        Half-open ``(start_layer, end_layer)`` ranges in rank order, covering every layer once.

    Raises:
        InvalidArgumentError: If ``method`` is unknown, ``num_stages`` is below 1 or exceeds
            the number of layers, or (for ``"parameters"``) a cost is invalid.
        InternalError: The registered function returned something other than a list of ranges.
    """
    ranges = get_partition(method)(costs, num_stages)
    if not isinstance(ranges, list) or len(ranges) != num_stages:
        raise InternalError(
            f"partition method {method!r} must return a list of {num_stages} ranges; got {ranges!r}"
        )
    return ranges


@register_partition("uniform")
def _uniform_method(costs: Sequence[int], num_stages: int) -> list[tuple[int, int]]:
    """Equal layer counts; the cost values are ignored."""
    return uniform(len(costs), num_stages)


register_partition("parameters")(balanced)
# With equal budgets, balancing memory is balancing these costs; the planner calls
# fit_capacities itself when the budgets differ.
register_partition("memory")(balanced)
# ``throughput`` plans from measured speeds (pipesvc.core.planning.throughput); until a job has
# measurements (when it starts, or re-partitions after losing a stage) it balances parameters.
register_partition("throughput")(balanced)


def max_stage_cost(costs: Sequence[int], ranges: Sequence[tuple[int, int]]) -> int:
    """Returns the largest total cost of any range (0 when there are no ranges).

    Args:
        costs: Per-layer cost.
        ranges: Half-open ``(start_layer, end_layer)`` ranges into ``costs``.

    Raises:
        InvalidArgumentError: If a range is reversed or falls outside ``costs``.
    """
    largest = 0
    for start, end in ranges:
        if not 0 <= start <= end <= len(costs):
            raise InvalidArgumentError(
                f"range [{start}, {end}) is not within layers [0, {len(costs)})"
            )
        largest = max(largest, sum(costs[start:end]))
    return largest
