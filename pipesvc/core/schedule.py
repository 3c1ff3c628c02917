"""Pipeline schedules as data: a registry of named action lists and the built-in schedules
(their dry run and checks: ``pipesvc.core.schedule_sim``).

[Note: schedule registry] A schedule is a name mapped (:func:`register_schedule`) to a function
``(*, rank, num_stages, num_microbatches) -> list[Action]``. Everything that names a schedule
asks the registry: the job configuration's check, the CLI's ``--schedule`` choices, the
planner's dry run and memory estimate, and each stage's run (:func:`stage_actions`). Every
process of a job (client, coordinator, stages) must register the same schedules, so a new one
goes in a module every process imports (as the built-in ones here).

[Note: micro-batches in flight] A micro-batch is *in flight* on a stage from its forward until
its backward: the stage keeps its activations for that long. :func:`max_in_flight` is the most a
schedule keeps on one rank at once, :func:`max_in_flight_of` the same measured on an action list.

[Note: virtual stages] With ``virtual_stages=V`` the model is cut into ``num_stages * V``
ranges and stage ``r`` holds ranges ``r, r + P, r + 2P, ...``: its *chunks* 0..V-1. An action
names its chunk (``F3@1``). Virtual stage ``v = chunk * P + rank`` feeds ``v + 1``, so the last
stage's chunk ``c`` feeds the first stage's chunk ``c + 1``: activations go round the stages V
times. A schedule registered with ``virtual=True`` takes ``virtual_stages``; the others hold
one chunk. A micro-batch's chunk in flight keeps only that chunk's activations.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pipesvc.core.action import Action, ActionKind
from pipesvc.core.schedule_sim import (
    bubble_fraction,
    check_num_microbatches,
    dependencies,
    simulate,
)
from pipesvc.errors import InternalError, InvalidArgumentError
from pipesvc.name_registry import Registry

__all__ = [
    "SCHEDULE_NAME_PATTERN",
    "Action",
    "ActionKind",
    "Schedule",
    "all_stage_actions",
    "check_virtual_stages",
    "forward_only_actions",
    "get_schedule",
    "ideal_bubble",
    "max_in_flight",
    "max_in_flight_of",
    "register_schedule",
    "schedule_names",
    "stage_actions",
]

SCHEDULE_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
"""Schedule names: lowercase letters, digits, ``_`` and ``-`` (``1f1b`` starts with a digit)."""


def _forward(index: int) -> Action:
    return Action(ActionKind.FORWARD, index)


def _backward(index: int) -> Action:
    return Action(ActionKind.BACKWARD, index)


def _weight(index: int) -> Action:
    return Action(ActionKind.WEIGHT, index)


class StageActionsFn(Protocol):
    """A schedule: the training actions of stage ``rank`` of ``num_stages``."""

    def __call__(self, *, rank: int, num_stages: int, num_microbatches: int) -> list[Action]: ...


class VirtualActionsFn(Protocol):
    """A schedule over virtual stages: the training actions of stage ``rank`` of
    ``num_stages``, each holding ``virtual_stages`` chunks (see [Note: virtual stages])."""

    def __call__(
        self, *, rank: int, num_stages: int, num_microbatches: int, virtual_stages: int
    ) -> list[Action]: ...


class InFlightFn(Protocol):
    """A closed form of :func:`max_in_flight` for one schedule (same arguments)."""

    def __call__(self, *, rank: int, num_stages: int, num_microbatches: int) -> int: ...


_ActionsT = TypeVar("_ActionsT", bound=StageActionsFn)


@dataclass(frozen=True, slots=True)
class Schedule:
    """One registered schedule."""

    name: str
    actions: StageActionsFn
    """Returns one stage's training actions; called with checked arguments."""
    in_flight: InFlightFn | None = None
    """Closed form of the most micro-batches in flight on a rank, or None to measure it on the
    action list (the closed form keeps planning fast at thousands of micro-batches)."""
    virtual: bool = False
    """The action function takes ``virtual_stages`` (a ``VirtualActionsFn``)."""


_SCHEDULES: Registry[Schedule] = Registry(
    "schedule", SCHEDULE_NAME_PATTERN, origin=lambda found: found.actions
)


def register_schedule(
    name: str, *, in_flight: InFlightFn | None = None, virtual: bool = False
) -> Callable[[_ActionsT], _ActionsT]:
    """Returns a decorator that registers a schedule's action function under ``name``.

    ``in_flight``, if given, must equal :func:`max_in_flight_of` of the function's lists (a
    unit test checks this for every registered schedule). ``virtual``: the function is a
    ``VirtualActionsFn`` (see [Note: virtual stages]).

    Raises:
        InvalidArgumentError: ``name`` does not match :data:`SCHEDULE_NAME_PATTERN`, or is
            already registered to a different function.
    """
    _SCHEDULES.check_name(name)

    def decorator(actions: _ActionsT) -> _ActionsT:
        _SCHEDULES.register(name, Schedule(name, actions, in_flight, virtual))
        return actions

    return decorator


def schedule_names() -> tuple[str, ...]:
    """Returns the registered schedule names, in registration order."""
    return _SCHEDULES.names()


def get_schedule(name: str) -> Schedule:
    """Returns the schedule registered under ``name``.

    Raises:
        InvalidArgumentError: ``name`` is not registered; the message lists the known names.
    """
    return _SCHEDULES.get(name)


def _check_stage(rank: int, num_stages: int, num_microbatches: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InvalidArgumentError(f"num_stages ({num_stages!r}) must be at least 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_stages:
        raise InvalidArgumentError(f"rank ({rank!r}) must be in [0, {num_stages})")
    check_num_microbatches(num_microbatches)


def check_virtual_stages(schedule: str, virtual_stages: int) -> None:
    """Checks that ``schedule`` can run ``virtual_stages`` chunks per stage.

    Raises:
        InvalidArgumentError: ``virtual_stages`` is below 1, or above 1 for a schedule that
            holds one chunk per stage.
    """
    if (
        isinstance(virtual_stages, bool)
        or not isinstance(virtual_stages, int)
        or virtual_stages < 1
    ):
        raise InvalidArgumentError(f"virtual_stages ({virtual_stages!r}) must be at least 1")
    if virtual_stages > 1 and not get_schedule(schedule).virtual:
        virtual = [n for n in schedule_names() if get_schedule(n).virtual]
        raise InvalidArgumentError(
            f"schedule {schedule!r} holds one layer range per stage; virtual_stages "
            f"({virtual_stages}) needs one of {virtual}"
        )


def stage_actions(
    schedule: str,
    *,
    rank: int,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> list[Action]:
    """Returns the training actions of one stage under the named schedule.

    Raises:
        InvalidArgumentError: If ``schedule`` is not registered, ``num_stages`` or
            ``num_microbatches`` is below 1, ``rank`` is outside ``[0, num_stages)``, or
            ``virtual_stages`` does not suit the schedule.
        InternalError: The registered function returned something other than a list of
            actions.
    """
    found = get_schedule(schedule)
    _check_stage(rank, num_stages, num_microbatches)
    check_virtual_stages(schedule, virtual_stages)
    if found.virtual:
        virtual_fn: Any = found.actions
        actions = virtual_fn(
            rank=rank,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            virtual_stages=virtual_stages,
        )
    else:
        actions = found.actions(rank=rank, num_stages=num_stages, num_microbatches=num_microbatches)
    if not isinstance(actions, list) or not all(isinstance(a, Action) for a in actions):
        raise InternalError(f"schedule {schedule!r} must return a list of Action")
    return actions


def all_stage_actions(
    schedule: str, *, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """Returns every stage's training actions, in rank order (the input of :func:`validate`).

    Raises:
        InvalidArgumentError: As :func:`stage_actions`.
    """
    get_schedule(schedule)
    _check_stage(0, num_stages, num_microbatches)
    return [
        stage_actions(
            schedule,
            rank=rank,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            virtual_stages=virtual_stages,
        )
        for rank in range(num_stages)
    ]


def _gpipe_in_flight(*, rank: int, num_stages: int, num_microbatches: int) -> int:
    return num_microbatches


@register_schedule("gpipe", in_flight=_gpipe_in_flight)
def gpipe(*, rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """GPipe: every forward in order, then every backward in order; all ``num_microbatches``
    are in flight at once on every stage."""
    m = num_microbatches
    return [_forward(i) for i in range(m)] + [_backward(i) for i in range(m)]


def _one_f_one_b_in_flight(*, rank: int, num_stages: int, num_microbatches: int) -> int:
    return min(num_microbatches, num_stages - rank)


@register_schedule("1f1b", in_flight=_one_f_one_b_in_flight)
def one_f_one_b(*, rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """1F1B: a warm-up of ``min(num_stages - rank - 1, num_microbatches)`` forwards, then
    alternately one forward and one backward, then the remaining backwards, so at most
    ``num_stages - rank`` micro-batches are in flight on a stage."""
    m = num_microbatches
    warmup = min(num_stages - rank - 1, m)
    actions = [_forward(i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [_forward(warmup + i), _backward(i)]
    actions += [_backward(i) for i in range(m - warmup, m)]
    return actions


def _zero_bubble_in_flight(*, rank: int, num_stages: int, num_microbatches: int) -> int:
    return min(num_microbatches, 2 * num_stages - rank - 1)


@functools.lru_cache(maxsize=64)
def _zero_bubble_lists(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's zb-h1 list, built by running the pipeline in unit ticks (see zb_h1)."""
    p, m = num_stages, num_microbatches
    lists: list[list[Action]] = [[] for _ in range(p)]
    forward_at: dict[tuple[int, int], int] = {}
    backward_at: dict[tuple[int, int], int] = {}
    forwards, backwards, weights = [0] * p, [0] * p, [0] * p
    tick = 0
    while any(len(actions) < 3 * m for actions in lists):
        for r in range(p):
            f, b = forwards[r], backwards[r]
            if (
                b < f
                and forward_at[r, b] < tick
                and (r == p - 1 or backward_at.get((r + 1, b), tick) < tick)
            ):
                backward_at[r, b] = tick
                backwards[r] += 1
                lists[r].append(_backward(b))
            elif (
                f < m
                and f - b < p - r
                and f - weights[r] < 2 * p - r - 1
                and (r == 0 or forward_at.get((r - 1, f), tick) < tick)
            ):
                forward_at[r, f] = tick
                forwards[r] += 1
                lists[r].append(_forward(f))
            elif weights[r] < b:
                lists[r].append(_weight(weights[r]))
                weights[r] += 1
        tick += 1
    return tuple(tuple(actions) for actions in lists)


@register_schedule("zb-h1", in_flight=_zero_bubble_in_flight)
def zb_h1(*, rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Zero bubble, H1 shape (after Qi et al., "Zero Bubble Pipeline Parallelism", ICLR '24):
    every backward is split (see [Note: split backward]): ``B`` sends the input's gradient
    upstream at once, and the weight gradients ``W`` fill the waits. Built by running the
    pipeline in unit ticks (F, B and W one tick each), each rank taking, in order of
    preference, the backward whose gradient has arrived, a forward while fewer than
    ``num_stages - rank`` micro-batches await their backward (1F1B's bound) and fewer than
    ``2 * num_stages - rank - 1`` their weight gradient, else its oldest weight gradient.
    A step then takes ``3 m + p - 1`` ticks against 1F1B's ``3 (m + p - 1)`` (its backward
    two ticks): the bubble shrinks about threefold. A micro-batch waiting for ``W`` still
    holds its linear layers' inputs and output gradients, so it counts as in flight: at most
    ``2 * num_stages - rank - 1`` on a rank (what its memory estimate charges), up to about
    twice 1F1B's."""
    return list(_zero_bubble_lists(num_stages, num_microbatches)[rank])


def _interleaved_order(num_stages: int, num_microbatches: int, chunks: list[int]) -> list[Action]:
    """Forwards (or, with ``chunks`` reversed, backwards) in the interleaved order: the
    micro-batches in groups of ``num_stages``, each group through every chunk in turn."""
    p, m = num_stages, num_microbatches
    order = []
    for start in range(0, m, p):
        group = range(start, min(start + p, m))
        order += [Action(ActionKind.FORWARD, mb, c) for c in chunks for mb in group]
    return order


def _interleaved_warmup(rank: int, num_stages: int, virtual_stages: int) -> int:
    """Megatron's warm-up forwards on ``rank``: ``2 (P - r - 1) + (V - 1) P`` chunks, or
    1F1B's ``P - r - 1`` with one chunk."""
    if virtual_stages == 1:
        return num_stages - rank - 1
    return 2 * (num_stages - rank - 1) + (virtual_stages - 1) * num_stages


def _interleaved_in_flight(*, rank: int, num_stages: int, num_microbatches: int) -> int:
    return min(num_microbatches, num_stages - rank)


@functools.lru_cache(maxsize=64)
def _interleaved_lists(
    num_stages: int, num_microbatches: int, virtual_stages: int
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's interleaved-1f1b list, built by running the pipeline in unit ticks (see
    interleaved_1f1b)."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    total = m * v
    forwards = _interleaved_order(p, m, list(range(v)))
    backwards = [
        Action(ActionKind.BACKWARD, a.microbatch_index, a.chunk)
        for a in _interleaved_order(p, m, list(reversed(range(v))))
    ]
    lists: list[list[Action]] = [[] for _ in range(p)]
    done: dict[tuple[int, Action], int] = {}
    f_next, b_next = [0] * p, [0] * p
    caps = [min(total, _interleaved_warmup(r, p, v) + 1) for r in range(p)]
    tick = 0
    while any(b < total for b in b_next):
        for r in range(p):
            if f_next[r] < total and f_next[r] - b_next[r] < caps[r]:
                action = forwards[f_next[r]]
                if all(done.get(need, tick) < tick for need in dependencies(action, r, p, v)):
                    done[r, action] = tick
                    f_next[r] += 1
                    lists[r].append(action)
                    continue
            if b_next[r] < total:
                action = backwards[b_next[r]]
                if all(done.get(need, tick) < tick for need in dependencies(action, r, p, v)):
                    done[r, action] = tick
                    b_next[r] += 1
                    lists[r].append(action)
        tick += 1
        if tick > 4 * total * p + 16:  # the greedy always progresses; a guard, not a path
            raise InternalError(f"interleaved schedule p={p} m={m} v={v} did not finish")
    return tuple(tuple(actions) for actions in lists)


@register_schedule("interleaved-1f1b", in_flight=_interleaved_in_flight, virtual=True)
def interleaved_1f1b(
    *, rank: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> list[Action]:
    """Interleaved 1F1B (after Narayanan et al., "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", SC '21): each stage holds ``virtual_stages``
    chunks (see [Note: virtual stages]); forwards take the micro-batches in groups of
    ``num_stages`` through chunk 0, then chunk 1, ...; backwards the same groups through the
    chunks in reverse. Built by running the pipeline in unit ticks (each chunk's F or B one
    tick, a V-th of a whole stage's), each rank taking its next backward once its gradient
    has arrived, else its next forward while fewer than ``2 (P - r - 1) + (V - 1) P + 1``
    chunks of micro-batches await their backward (Megatron's warm-up). The fill and drain
    take about ``2 (P - 1)`` ticks against ``2 V m`` of work, so the bubble shrinks about V
    times against 1F1B; each stage sends V times as many (smaller) activations. With one
    chunk it is 1F1B."""
    return list(_interleaved_lists(num_stages, num_microbatches, virtual_stages)[rank])


def forward_only_actions(num_microbatches: int, chunks: int = 1) -> list[Action]:
    """Returns the actions of any stage for inference: ``F0 .. F(m-1)`` of chunk 0, then of
    chunk 1, ... (``chunks`` per stage, see [Note: virtual stages]).

    Raises:
        InvalidArgumentError: If ``num_microbatches`` is below 1.
    """
    check_num_microbatches(num_microbatches)
    return [
        Action(ActionKind.FORWARD, i, c) for c in range(chunks) for i in range(num_microbatches)
    ]


def max_in_flight_of(actions: Sequence[Action]) -> int:
    """Returns the most micro-batches in flight (forward run, last backward pass not yet: ``W``
    where the list has one, else ``B``) over ``actions``; with chunks, each micro-batch's
    chunk counts apart (see [Note: virtual stages])."""
    split = {(a.microbatch_index, a.chunk) for a in actions if a.kind is ActionKind.WEIGHT}
    in_flight: set[tuple[int, int]] = set()
    most = 0
    for action in actions:
        key = (action.microbatch_index, action.chunk)
        if action.kind is ActionKind.FORWARD:
            in_flight.add(key)
            most = max(most, len(in_flight))
        elif action.kind is ActionKind.WEIGHT or key not in split:
            in_flight.discard(key)
    return most


def ideal_bubble(
    name: str, *, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """The idle share of schedule ``name``'s dry run with every action one tick: its bubble
    when forward, backward (and a split backward's two passes) cost the same on every stage
    and links are free (a chunk's passes a V-th of a stage's). ``(p - 1) / (m + p - 1)`` for
    GPipe and 1F1B, ``(p - 1) / (3m + p - 1)`` for zb-h1 once ``m >= p``.

    Raises:
        InvalidArgumentError: As :func:`stage_actions`.
    """
    actions = all_stage_actions(
        name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        virtual_stages=virtual_stages,
    )
    return bubble_fraction(simulate(actions))


def max_in_flight(
    name: str, *, rank: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> int:
    """Returns the most micro-batches in flight at once on ``rank`` under schedule ``name``:
    the activations that rank keeps (``num_microbatches`` with GPipe, ``num_stages - rank``
    with 1F1B, capped at ``num_microbatches``); with chunks, micro-batch chunks (see [Note:
    virtual stages]).

    Raises:
        InvalidArgumentError: As :func:`stage_actions`.
    """
    found = get_schedule(name)
    _check_stage(rank, num_stages, num_microbatches)
    if found.in_flight is not None and virtual_stages == 1:
        return found.in_flight(rank=rank, num_stages=num_stages, num_microbatches=num_microbatches)
    return max_in_flight_of(
        stage_actions(
            name,
            rank=rank,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            virtual_stages=virtual_stages,
        )
    )
