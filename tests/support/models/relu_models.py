"""A model whose every other layer has no parameters, loaded by stages with ``--models``."""

from __future__ import annotations

from torch import nn

import pipesvc


@pipesvc.register_model("relu-mlp")
def relu_mlp(width: int = 6, depth: int = 3) -> list[pipesvc.LayerSpec]:
    """``[Linear, ReLU] * depth`` then a Linear: layers 1, 3, ... hold no tensors."""
    specs: list[pipesvc.LayerSpec] = []
    for _ in range(depth):
        specs += [pipesvc.LayerSpec(nn.Linear, width, width), pipesvc.LayerSpec(nn.ReLU)]
    specs.append(pipesvc.LayerSpec(nn.Linear, width, 3))
    return specs
