"""Deferred weight gradients: a backward that leaves the matrix products' weight gradients for
later (see [Note: split backward] in pipesvc.core.action).

Under ``DeferWeightGrads(store)`` every ``torch.nn.functional.linear`` (every ``nn.Linear``)
whose weight trains runs as ``_DeferredLinear``: its backward computes only the input's
gradient and records the layer input and output gradient in ``store``; ``store.apply()`` later
adds ``grad_output^T @ input`` (and the bias's row sum) to the parameters' gradients. Other
parameters (norms, embeddings) get theirs in the backward as usual. Under autocast the linear
runs as usual (its weight gradient is not deferred), so the result is the same either way.

[Note: computed weights] A linear layer's weight (or bias) need not be a parameter: weight_norm,
spectral_norm and other parametrizations compute it from parameters in the forward, and
``MultiheadAttention`` cuts its projections out of a packed one. Such a tensor gets no
``.grad`` that the optimizer sees; its gradient must flow through the computation to the
parameters. The deferred linear takes it detached, so B's backward leaves that computation's
graph whole, and W passes the computed gradient into it with ``torch.autograd.backward`` (one
call for all of a micro-batch's computed tensors, each tensor's gradients summed, since layers
may share parts of one graph). That is exact only if the computation reads nothing but
parameters: a weight computed from the layer's input (a hypernetwork) also carries part of the
input's gradient, which B must send upstream, so a linear whose weight or bias depends on
anything else runs as usual, undeferred (``_from_parameters``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import Node
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
        # Computed weights and biases by identity: (the tensor, its summed gradient).
        computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for x, grad, weight, bias in pending:
            rows = grad.reshape(-1, grad.shape[-1])
            _accumulate(weight, rows.t().mm(x.reshape(-1, x.shape[-1])), computed)
            if bias is not None and bias.requires_grad:
                _accumulate(bias, rows.sum(0), computed)
        if computed:  # through their computation to the parameters (see [Note: computed weights])
            tensors, grads = zip(*computed.values(), strict=True)
            torch.autograd.backward(list(tensors), list(grads))


def _accumulate(
    param: torch.Tensor,
    grad: torch.Tensor,
    computed: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    if not param.is_leaf:
        held = computed.get(id(param))
        total = grad.to(param.dtype) if held is None else held[1] + grad
        computed[id(param)] = (param, total)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


_MAX_GRAPH_NODES = 64
"""The most autograd nodes ``_from_parameters`` walks; a larger computation runs undeferred."""


def _from_parameters(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor``'s gradient can wait for W: it is a parameter, or is computed from
    parameters alone in a small graph (see [Note: computed weights])."""
    if tensor is None or tensor.grad_fn is None:
        return True
    stack: list[Node | None] = [tensor.grad_fn]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if len(seen) > _MAX_GRAPH_NODES:
            return False
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
        if leaf is not None:
            if not isinstance(leaf, nn.Parameter):
                return False
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return True


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A computed tensor cut from its graph (kept whole for W); a parameter as it is."""
    return tensor.detach() if tensor is not None and not tensor.is_leaf else tensor


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        store: WeightGradStore,
        computed: tuple[torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        """``weight`` and ``bias`` are detached if computed; ``computed`` holds them as the
        forward computed them, for W (see [Note: computed weights])."""
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.computed = store, computed
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.store.add(x.detach(), grad.detach(), *ctx.computed)
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


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
                and _from_parameters(weight)
                and _from_parameters(bias)
            ):
                return _DeferredLinear.apply(  # type: ignore[no-untyped-call]
                    x, _detached(weight), _detached(bias), self.store, (weight, bias)
                )
        return func(*args, **kwargs)
