"""Deferred weight gradients: a backward that leaves the matrix products' weight gradients for
later (see [Note: split backward] in pipesvc.core.action).

Under ``DeferWeightGrads(store)`` every ``torch.nn.functional.linear`` (every ``nn.Linear``)
whose weight trains runs as ``_DeferredLinear``: its backward computes only the input's
gradient and records the layer input and output gradient in ``store``; ``store.apply()`` later
adds ``grad_output^T @ input`` (and the bias's row sum) to the parameters' gradients. Other
parameters (norms, embeddings) get theirs in the backward as usual. Under autocast the linear
runs as usual (its weight gradient is not deferred), so the result is the same either way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A linear layer's input, its output's gradient, its weight and its bias."""


class WeightGradStore:
    """The weight gradients one micro-batch's backward left for later."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self, x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        self._pending.append((x, grad, weight, bias))

    def apply(self) -> None:
        """Adds every recorded weight gradient to its parameter's ``.grad``, in the order the
        backward recorded them (the order one backward would have added them in)."""
        pending, self._pending = self._pending, []
        for x, grad, weight, bias in pending:
            rows = grad.reshape(-1, grad.shape[-1])
            _accumulate(weight, rows.t().mm(x.reshape(-1, x.shape[-1])))
            if bias is not None and bias.requires_grad:
                _accumulate(bias, rows.sum(0))


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        store: WeightGradStore,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.bias = store, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.store.add(x.detach(), grad.detach(), weight, ctx.bias)
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class DeferWeightGrads(TorchFunctionMode):
    """Within it, trained linear layers leave their weight gradients in ``store``."""

    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            x, weight, bias = named["input"], named["weight"], named.get("bias")
            if (
                weight.requires_grad
                and torch.is_grad_enabled()
                and not torch.is_autocast_enabled(x.device.type)
            ):
                return _DeferredLinear.apply(x, weight, bias, self.store)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)
