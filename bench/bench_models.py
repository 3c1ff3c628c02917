"""Models the benchmarks register on their stages (``--models bench.bench_models``)."""

from __future__ import annotations

from torch import nn

import pipesvc


def _linear_relu(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


@pipesvc.register_model("bench-mlp")
def bench_mlp(width: int = 1024, depth: int = 8) -> list[pipesvc.LayerSpec]:
    """``depth`` x (Linear(width, width) + ReLU); input and output ``(B, width)``."""
    return [pipesvc.LayerSpec(_linear_relu, width) for _ in range(depth)]


@pipesvc.register_model("bench-linear")
def bench_linear(width: int = 2048, depth: int = 48) -> list[pipesvc.LayerSpec]:
    """``depth`` x Linear(width, width): the memory benchmark's model."""
    return [pipesvc.LayerSpec(nn.Linear, width, width) for _ in range(depth)]
