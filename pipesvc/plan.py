"""The plan: which stage server holds which half-open layer range, at which rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipesvc.errors import InvalidArgumentError


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineStage:
    """One stage of a plan: layers ``[start_layer, end_layer)`` on the server at ``address``."""

    start_layer: int
    """First layer held (inclusive)."""
    end_layer: int
    """One past the last layer held."""
    rank: int
    """Position in the pipeline; 0 holds the first layers."""
    address: str = ""
    """host:port of the stage server."""

    @property
    def num_layers(self) -> int:
        """How many layers this stage holds."""
        return self.end_layer - self.start_layer


def plan_to_dicts(plan: Sequence[PipelineStage]) -> list[dict[str, Any]]:
    """A plan as JSON-ready dicts (for manifests and the state database)."""
    return [
        {
            "start_layer": s.start_layer,
            "end_layer": s.end_layer,
            "rank": s.rank,
            "address": s.address,
        }
        for s in plan
    ]


def check_plan(plan: Sequence[PipelineStage], num_layers: int) -> None:
    """Checks that ``plan`` covers ``[0, num_layers)`` exactly once with ranks 0..n-1 in order.

    Raises:
        InvalidArgumentError: a gap, overlap, empty stage or rank out of order.
    """
    expected_start = 0
    for position, stage in enumerate(plan):
        if stage.rank != position:
            raise InvalidArgumentError(f"plan stage {position} has rank {stage.rank}")
        if stage.start_layer != expected_start or stage.end_layer <= stage.start_layer:
            raise InvalidArgumentError(
                f"plan stage {position} holds [{stage.start_layer}, {stage.end_layer}); "
                f"expected a non-empty range starting at {expected_start}"
            )
        expected_start = stage.end_layer
    if expected_start != num_layers:
        raise InvalidArgumentError(f"plan covers {expected_start} layers of {num_layers}")
