"""An operator's own model module, loaded by stages with ``--models``."""

from __future__ import annotations

from torch import nn

import pipesvc


@pipesvc.register_model("tiny-tanh")
def tiny_tanh(width: int = 4, depth: int = 3) -> list[pipesvc.LayerSpec]:
    """``depth`` blocks of Linear(width, width) + Tanh."""
    return [
        pipesvc.LayerSpec(lambda: nn.Sequential(nn.Linear(width, width), nn.Tanh()))
        for _ in range(depth)
    ]
