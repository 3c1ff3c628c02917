"""A dry run of a schedule's action lists: the tick grid it runs in, its checks (every
micro-batch's actions once each, in an order that can run), its bubble and a readable grid
(no gRPC, no torch).

Virtual stage ``chunk * num_stages + rank`` follows the one before it (see [Note: virtual
stages] in ``pipesvc.core.schedule``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipesvc.core.action import Action, ActionKind
from pipesvc.errors import InvalidArgumentError


def num_chunks(actions_per_stage: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.chunk for actions in actions_per_stage for a in actions), default=0)


def check_num_microbatches(num_microbatches: int) -> None:
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
    ):
        raise InvalidArgumentError(f"num_microbatches ({num_microbatches!r}) must be at least 1")


def dependencies(
    action: Action, rank: int, num_stages: int, num_chunks: int = 1
) -> list[tuple[int, Action]]:
    """Returns the ``(rank, action)`` pairs that must finish in an earlier tick than ``action``
    (virtual stage ``chunk * num_stages + rank`` follows the one before it, see [Note:
    virtual stages])."""
    index, chunk = action.microbatch_index, action.chunk
    virtual = chunk * num_stages + rank
    if action.kind is ActionKind.FORWARD:
        if virtual == 0:
            return []
        before = virtual - 1
        return [(before % num_stages, Action(ActionKind.FORWARD, index, before // num_stages))]
    if action.kind is ActionKind.WEIGHT:
        return [(rank, Action(ActionKind.BACKWARD, index, chunk))]
    needs = [(rank, Action(ActionKind.FORWARD, index, chunk))]
    if virtual < num_stages * num_chunks - 1:
        after = virtual + 1
        needs.append((after % num_stages, Action(ActionKind.BACKWARD, index, after // num_stages)))
    return needs


def simulate(
    actions_per_stage: Sequence[Sequence[Action]], *, training: bool = True
) -> list[list[Action | None]]:
    """Dry-runs a schedule with unit-time actions and returns the stage x tick grid.

    Rules: stage ``r`` may run ``F(mb)`` once stage ``r-1`` ran ``F(mb)`` in an earlier tick;
    ``B(mb)`` once it ran its own ``F(mb)`` and (except on the last stage) stage ``r+1`` ran
    ``B(mb)``, both in earlier ticks; ``W(mb)`` once it ran its own ``B(mb)``. Each stage runs
    its list strictly in order, at most one action per tick, as early as it can. Idle slots are
    ``None``.

    Raises:
        InvalidArgumentError: If ``training`` is false and a stage has a backward action, or
            if the schedule deadlocks; the message then says which action each stuck stage
            waits for and shows the grid so far.
    """
    num_stages = len(actions_per_stage)
    chunks = num_chunks(actions_per_stage)
    if not training:
        for rank, actions in enumerate(actions_per_stage):
            for action in actions:
                if action.kind is not ActionKind.FORWARD:
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
                needs = dependencies(action, rank, num_stages, chunks)
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
    chunks = num_chunks(actions_per_stage)
    lines = [f"schedule deadlocks at tick {len(grid[0]) if grid else 0}:"]
    for rank, actions in enumerate(actions_per_stage):
        if positions[rank] >= len(actions):
            continue
        action = actions[positions[rank]]
        waits = []
        for need_rank, need in dependencies(action, rank, num_stages, chunks):
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
    and, when ``training``, each ``B(mb)`` exactly once and after ``F(mb)``, and any ``W(mb)``
    (see [Note: split backward]) at most once and after ``B(mb)`` (no backward at all
    otherwise); then the schedule must simulate without deadlock (:func:`simulate`).

    Raises:
        InvalidArgumentError: Naming the stage and the problem: no stages, a missing, repeated
            or out-of-range action, a backward before its forward, or a deadlock.
    """
    check_num_microbatches(num_microbatches)
    if not actions_per_stage:
        raise InvalidArgumentError("a schedule needs at least one stage; got none")
    chunks = num_chunks(actions_per_stage)
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
            if action.kind is not ActionKind.FORWARD:
                if not training:
                    raise InvalidArgumentError(
                        f"rank {rank}: backward action {action} in a forward-only schedule"
                    )
                before = Action(
                    ActionKind.FORWARD
                    if action.kind is ActionKind.BACKWARD
                    else ActionKind.BACKWARD,
                    action.microbatch_index,
                    action.chunk,
                )
                if before not in seen:
                    raise InvalidArgumentError(f"rank {rank}: {action} comes before {before}")
            seen.add(action)
        kinds = [ActionKind.FORWARD, ActionKind.BACKWARD] if training else [ActionKind.FORWARD]
        missing = [
            str(Action(kind, i, c))
            for kind in kinds
            for c in range(chunks)
            for i in range(num_microbatches)
            if Action(kind, i, c) not in seen
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
