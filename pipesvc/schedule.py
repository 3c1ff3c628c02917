"""Pipeline schedules as data: per-stage action lists, their checks and a dry-run simulator."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipesvc.errors import InvalidArgumentError

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "bubble_fraction",
    "format_grid",
    "forward_only_actions",
    "max_live_activations",
    "simulate",
    "stage_actions",
    "validate",
]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
"""Schedule names accepted by :func:`stage_actions`."""

_ACTION_PATTERN = re.compile(r"([FB])(0|[1-9][0-9]*)")


class ActionKind(enum.Enum):
    """What a stage does with one micro-batch."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True, repr=False)
class Action:
    """One step of a stage's schedule; prints as ``"F0"`` / ``"B12"`` and parses back."""

    kind: ActionKind
    """Forward or backward."""
    microbatch_index: int
    """Which micro-batch of the step, from 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise InvalidArgumentError(f"action kind ({self.kind!r}) must be an ActionKind")
        index = self.microbatch_index
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgumentError(f"microbatch_index ({index!r}) must be a non-negative int")

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch_index}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parses ``"F0"`` / ``"B12"`` (the output of ``str``) back into an action.

        Raises:
            InvalidArgumentError: If ``text`` is not ``F`` or ``B`` followed by a canonical
                non-negative decimal number.
        """
        match = _ACTION_PATTERN.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise InvalidArgumentError(
                f"cannot parse action {text!r}; expected 'F' or 'B' and a micro-batch index, "
                "e.g. 'F0' or 'B12'"
            )
        return cls(ActionKind(match.group(1)), int(match.group(2)))


def _forward(index: int) -> Action:
    return Action(ActionKind.FORWARD, index)


def _backward(index: int) -> Action:
    return Action(ActionKind.BACKWARD, index)


def _check_num_microbatches(num_microbatches: int) -> None:
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
    ):
        raise InvalidArgumentError(f"num_microbatches ({num_microbatches!r}) must be at least 1")


def stage_actions(
    schedule: str, *, rank: int, num_stages: int, num_microbatches: int
) -> list[Action]:
    """Returns the training actions of one stage under the named schedule.

    ``"gpipe"``: every forward in order, then every backward in order. ``"1f1b"``: a warm-up of
    ``min(num_stages - rank - 1, num_microbatches)`` forwards, then alternately one forward and
    one backward, then the remaining backwards, so the stage never holds more than
    ``num_stages - rank`` micro-batches' activations.

    Raises:
        InvalidArgumentError: If ``schedule`` is unknown, ``num_stages`` or
            ``num_microbatches`` is below 1, or ``rank`` is outside ``[0, num_stages)``.
    """
    if schedule not in SCHEDULES:
        raise InvalidArgumentError(
            f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}"
        )
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InvalidArgumentError(f"num_stages ({num_stages!r}) must be at least 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_stages:
        raise InvalidArgumentError(f"rank ({rank!r}) must be in [0, {num_stages})")
    _check_num_microbatches(num_microbatches)
    m = num_microbatches
    if schedule == "gpipe":
        return [_forward(i) for i in range(m)] + [_backward(i) for i in range(m)]
    warmup = min(num_stages - rank - 1, m)
    actions = [_forward(i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [_forward(warmup + i), _backward(i)]
    actions += [_backward(i) for i in range(m - warmup, m)]
    return actions


def forward_only_actions(num_microbatches: int) -> list[Action]:
    """Returns the actions of any stage for inference: ``F0 .. F(m-1)``.

    Raises:
        InvalidArgumentError: If ``num_microbatches`` is below 1.
    """
    _check_num_microbatches(num_microbatches)
    return [_forward(i) for i in range(num_microbatches)]


def max_live_activations(actions: Sequence[Action]) -> int:
    """Returns the most micro-batches whose forward has run and whose backward has not."""
    live: set[int] = set()
    most = 0
    for action in actions:
        if action.kind is ActionKind.FORWARD:
            live.add(action.microbatch_index)
            most = max(most, len(live))
        else:
            live.discard(action.microbatch_index)
    return most


def _dependencies(action: Action, rank: int, num_stages: int) -> list[tuple[int, Action]]:
    """Returns the ``(rank, action)`` pairs that must finish in an earlier tick than ``action``."""
    index = action.microbatch_index
    if action.kind is ActionKind.FORWARD:
        return [(rank - 1, action)] if rank > 0 else []
    needs = [(rank, _forward(index))]
    if rank < num_stages - 1:
        needs.append((rank + 1, action))
    return needs


def simulate(
    actions_per_stage: Sequence[Sequence[Action]], *, training: bool = True
) -> list[list[Action | None]]:
    """Dry-runs a schedule with unit-time actions and returns the stage x tick grid.

    Rules: stage ``r`` may run ``F(mb)`` once stage ``r-1`` ran ``F(mb)`` in an earlier tick;
    ``B(mb)`` once it ran its own ``F(mb)`` and (except on the last stage) stage ``r+1`` ran
    ``B(mb)``, both in earlier ticks. Each stage runs its list strictly in order, at most one
    action per tick, as early as it can. Idle slots are ``None``.

    Raises:
        InvalidArgumentError: If ``training`` is false and a stage has a backward action, or
            if the schedule deadlocks; the message then says which action each stuck stage
            waits for and shows the grid so far.
    """
    num_stages = len(actions_per_stage)
    if not training:
        for rank, actions in enumerate(actions_per_stage):
            for action in actions:
                if action.kind is ActionKind.BACKWARD:
                    raise InvalidArgumentError(
                        f"rank {rank}: backward action {action} in a forward-only schedule"
                    )
    finished_at: dict[tuple[int, Action], int] = {}
    positions = [0] * num_stages
    grid: list[list[Action | None]] = [[] for _ in range(num_stages)]
    tick = 0
    while any(positions[r] < len(actions_per_stage[r]) for r in range(num_stages)):
        progressed = False
        for rank, actions in enumerate(actions_per_stage):
            slot: Action | None = None
            if positions[rank] < len(actions):
                action = actions[positions[rank]]
                needs = _dependencies(action, rank, num_stages)
                if all(finished_at.get(need, tick) < tick for need in needs):
                    finished_at.setdefault((rank, action), tick)
                    positions[rank] += 1
                    slot = action
                    progressed = True
            grid[rank].append(slot)
        if not progressed:
            for row in grid:
                row.pop()
            raise InvalidArgumentError(_deadlock_message(actions_per_stage, positions, grid))
        tick += 1
    return grid


def _deadlock_message(
    actions_per_stage: Sequence[Sequence[Action]],
    positions: Sequence[int],
    grid: Sequence[Sequence[Action | None]],
) -> str:
    """Describes what each stuck stage waits for, followed by the grid so far."""
    num_stages = len(actions_per_stage)
    lines = [f"schedule deadlocks at tick {len(grid[0]) if grid else 0}:"]
    for rank, actions in enumerate(actions_per_stage):
        if positions[rank] >= len(actions):
            continue
        action = actions[positions[rank]]
        waits = []
        for need_rank, need in _dependencies(action, rank, num_stages):
            done = need in actions_per_stage[need_rank][: positions[need_rank]]
            if done:
                continue
            where = "its own" if need_rank == rank else f"rank {need_rank}'s"
            later = need in actions_per_stage[need_rank][positions[need_rank] :]
            note = " (later in its list)" if need_rank == rank else ""
            waits.append(f"{where} {need}" + (note if later else " (never scheduled there)"))
        lines.append(f"  rank {rank} waits to run {action}, which needs {' and '.join(waits)}")
    lines.append(format_grid(grid))
    return "\n".join(lines)


def validate(
    actions_per_stage: Sequence[Sequence[Action]],
    num_microbatches: int,
    *,
    training: bool = True,
) -> list[list[Action | None]]:
    """Checks a whole schedule and returns its simulated grid.

    Every stage must run each ``F(mb)`` for ``mb`` in ``[0, num_microbatches)`` exactly once
    and, when ``training``, each ``B(mb)`` exactly once and after ``F(mb)`` (or no backward at
    all otherwise); then the schedule must simulate without deadlock (:func:`simulate`).

    Raises:
        InvalidArgumentError: Naming the stage and the problem: no stages, a missing, repeated
            or out-of-range action, a backward before its forward, or a deadlock.
    """
    _check_num_microbatches(num_microbatches)
    if not actions_per_stage:
        raise InvalidArgumentError("a schedule needs at least one stage; got none")
    for rank, actions in enumerate(actions_per_stage):
        seen: set[Action] = set()
        for action in actions:
            if action.microbatch_index >= num_microbatches:
                raise InvalidArgumentError(
                    f"rank {rank}: {action} is out of range for "
                    f"num_microbatches ({num_microbatches})"
                )
            if action in seen:
                raise InvalidArgumentError(f"rank {rank}: {action} appears more than once")
            if action.kind is ActionKind.BACKWARD:
                if not training:
                    raise InvalidArgumentError(
                        f"rank {rank}: backward action {action} in a forward-only schedule"
                    )
                if _forward(action.microbatch_index) not in seen:
                    raise InvalidArgumentError(
                        f"rank {rank}: {action} comes before F{action.microbatch_index}"
                    )
            seen.add(action)
        kinds = [ActionKind.FORWARD, ActionKind.BACKWARD] if training else [ActionKind.FORWARD]
        missing = [
            str(Action(kind, i))
            for kind in kinds
            for i in range(num_microbatches)
            if Action(kind, i) not in seen
        ]
        if missing:
            raise InvalidArgumentError(f"rank {rank}: missing {' '.join(missing)}")
    return simulate(actions_per_stage, training=training)


def format_grid(grid: Sequence[Sequence[Action | None]]) -> str:
    """Formats a stage x tick grid as one aligned row per stage, ``"."`` for idle ticks.

    Example: ``"rank 0 | F0 F1 .  B1"`` (one column per tick).
    """
    if not grid:
        return ""
    cells = [[str(a) if a is not None else "." for a in row] for row in grid]
    width = max((len(cell) for row in cells for cell in row), default=1)
    label_width = len(str(len(grid) - 1))
    lines = []
    for rank, row in enumerate(cells):
        body = " ".join(cell.ljust(width) for cell in row)
        lines.append(f"rank {rank:>{label_width}} | {body}".rstrip())
    return "\n".join(lines)


def bubble_fraction(grid: Sequence[Sequence[Action | None]]) -> float:
    """Returns idle slots / all slots of a grid (0.0 for an empty grid)."""
    total = sum(len(row) for row in grid)
    if total == 0:
        return 0.0
    idle = sum(1 for row in grid for slot in row if slot is None)
    return idle / total


def max_in_flight(name: str, *, rank: int, num_stages: int, num_microbatches: int) -> int:
    """Most micro-batches whose activations ``rank`` keeps at once under schedule ``name``:
    every one with GPipe, ``num_stages - rank`` with 1F1B (capped at ``num_microbatches``).

    Raises:
        InvalidArgumentError: unknown schedule or rank out of range.
    """
    if name not in SCHEDULES:
        raise InvalidArgumentError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")
    if not 0 <= rank < num_stages:
        raise InvalidArgumentError(f"rank {rank} is not in [0, {num_stages})")
    if name == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_stages - rank)
