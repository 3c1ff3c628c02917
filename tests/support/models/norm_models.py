"""An operator's model with BatchNorm, whose statistics span the batch it is given."""

from __future__ import annotations

from torch import nn

import pipesvc


def _normed(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())


@pipesvc.register_model("tiny-batchnorm")
def tiny_batchnorm(width: int = 4) -> list[pipesvc.LayerSpec]:
    """Linear, then Linear + BatchNorm1d + ReLU (layer 1), then Linear."""
    return [
        pipesvc.LayerSpec(nn.Linear, width, width),
        pipesvc.LayerSpec(_normed, width),
        pipesvc.LayerSpec(nn.Linear, width, width),
    ]
