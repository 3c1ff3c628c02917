"""One step of a pipeline schedule: a forward, backward or weight-gradient pass of one
micro-batch on one stage."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pipesvc.errors import InvalidArgumentError

__all__ = ["Action", "ActionKind"]

_ACTION_PATTERN = re.compile(r"([FBW])(0|[1-9][0-9]*)(?:@([1-9][0-9]*))?")


class ActionKind(enum.Enum):
    """What a stage does with one micro-batch.

    [Note: split backward] A stage whose list holds ``W(mb)`` splits that micro-batch's
    backward in two: ``B(mb)`` computes the gradient of the stage's input (and of the
    parameters outside matrix products) and sends it upstream, and ``W(mb)`` later computes the
    linear layers' weight gradients from the inputs and output gradients ``B`` recorded (see
    ``pipesvc.stage.compute.weight_grads``). Without ``W(mb)``, ``B(mb)`` does both. The micro-batch
    counts as in flight until its last backward pass.
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


@dataclass(frozen=True, slots=True, repr=False)
class Action:
    """One step of a stage's schedule; prints as ``"F0"`` / ``"B12"`` / ``"W3"`` (and, on a
    stage's chunk ``c > 0``, ``"F0@c"``) and parses back."""

    kind: ActionKind
    """Forward, backward, or the weight-gradient part of a split backward."""
    microbatch_index: int
    """Which micro-batch of the step, from 0."""
    chunk: int = 0
    """Which of the stage's layer ranges (see [Note: virtual stages] in
    ``pipesvc.core.schedule``); 0 for a stage that holds one."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise InvalidArgumentError(f"action kind ({self.kind!r}) must be an ActionKind")
        for name in ("microbatch_index", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} ({value!r}) must be a non-negative int")

    def __str__(self) -> str:
        chunk = f"@{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.microbatch_index}{chunk}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parses ``"F0"`` / ``"B12"`` / ``"W3"`` / ``"F0@1"`` (the output of ``str``) back
        into an action.

        Raises:
            InvalidArgumentError: If ``text`` is not ``F``, ``B`` or ``W`` followed by a
                canonical non-negative decimal number, and optionally ``@`` and a canonical
                positive chunk.
        """
        match = _ACTION_PATTERN.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise InvalidArgumentError(
                f"cannot parse action {text!r}; expected 'F', 'B' or 'W' and a micro-batch "
                "index, then '@' and a chunk above 0 for a later chunk, e.g. 'F0', 'B12', 'W3' "
                "or 'F2@1'"
            )
        return cls(ActionKind(match.group(1)), int(match.group(2)), int(match.group(3) or 0))
