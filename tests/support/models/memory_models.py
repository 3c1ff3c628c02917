"""A model whose middle layer runs out of memory on large micro-batches, loaded by stages with
``--models``: how a stage's memory exhaustion reaches the caller."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import pipesvc


def _exhaust(how: str) -> None:
    if how == "raise":  # what CUDA's allocator raises
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (a test)")
    # A real failed allocation: no process has 4 EiB of address space.
    torch.empty(1 << 62, dtype=torch.uint8)


class _ExhaustsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, how: str) -> torch.Tensor:
        ctx.how = how
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _exhaust(ctx.how)
        return grad, None


class Hungry(nn.Module):
    """Linear(width, width) that runs out of memory (in ``where``: forward or backward) on a
    micro-batch of more than ``rows`` rows."""

    def __init__(self, width: int, rows: int, where: str, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.rows, self.where, self.how = rows, where, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            if self.where == "forward":
                _exhaust(self.how)
            elif torch.is_grad_enabled():
                x = _ExhaustsInBackward.apply(x, self.how)  # type: ignore[no-untyped-call]
        return self.linear(x)  # type: ignore[no-any-return]


@pipesvc.register_model("hungry-mlp")
def hungry_mlp(
    width: int = 4, rows: int = 4, where: str = "forward", how: str = "raise"
) -> list[pipesvc.LayerSpec]:
    """Linear, then ``Hungry`` (layer 1), then Linear."""
    return [
        pipesvc.LayerSpec(nn.Linear, width, width),
        pipesvc.LayerSpec(Hungry, width, rows, where, how),
        pipesvc.LayerSpec(nn.Linear, width, width),
    ]
