"""A model whose linear layers' weights are computed (weight_norm's parametrization), loaded by
stages with ``--models``: their gradients must reach the parameters under every schedule."""

from __future__ import annotations

from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import pipesvc


def _normed_block(fan_in: int, width: int) -> nn.Module:
    return nn.Sequential(weight_norm(nn.Linear(fan_in, width)), nn.Tanh())


@pipesvc.register_model("weight-normed-mlp")
def weight_normed_mlp(width: int = 8, depth: int = 3) -> list[pipesvc.LayerSpec]:
    """``depth`` blocks of weight-normed Linear + Tanh (6 features in), then a Linear to 3."""
    specs = [pipesvc.LayerSpec(_normed_block, 6 if i == 0 else width, width) for i in range(depth)]
    return [*specs, pipesvc.LayerSpec(nn.Linear, width, 3)]
