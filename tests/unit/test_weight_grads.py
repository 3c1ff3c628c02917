"""Deferred weight gradients: B leaves the linear layers' weight gradients, W adds them."""

from __future__ import annotations

import torch

from pipesvc.stage.weight_grads import DeferWeightGrads, WeightGradStore


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.LayerNorm(5), torch.nn.ReLU(), torch.nn.Linear(5, 3)
    )


def fused_grads(m: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    m.zero_grad(set_to_none=True)
    m(x).square().sum().backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return grads


def test_backward_leaves_linear_weights_and_apply_adds_them() -> None:
    m, x = model(), torch.randn(2, 7, 4, requires_grad=True)
    expected = fused_grads(m, x)
    expected_x = torch.autograd.grad(m(x).square().sum(), x)[0]
    store = WeightGradStore()
    with DeferWeightGrads(store):
        y = m(x).square().sum()
    x.grad = None
    y.backward()
    assert len(store) == 2
    assert m[0].weight.grad is None and m[3].bias.grad is None  # left for W
    assert m[1].weight.grad is not None  # the norm's come with B
    torch.testing.assert_close(x.grad, expected_x)
    store.apply()
    assert len(store) == 0
    for key, p in m.named_parameters():
        torch.testing.assert_close(p.grad, expected[key], rtol=1e-6, atol=1e-7)


def test_frozen_weights_and_biases_are_left_alone() -> None:
    m, x = model(), torch.randn(3, 4)
    m[0].weight.requires_grad_(False)
    m[3].bias.requires_grad_(False)
    expected = fused_grads(m, x)
    store = WeightGradStore()
    with DeferWeightGrads(store):
        y = m(x).square().sum()
    y.backward()
    assert len(store) == 1  # only the second linear trains its weight
    store.apply()
    assert m[0].weight.grad is None and m[3].bias.grad is None
    for key, p in m.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, expected[key], rtol=1e-6, atol=1e-7)


def test_autocast_runs_the_linear_as_usual() -> None:
    m, x = model(), torch.randn(3, 4)
    store = WeightGradStore()
    with torch.autocast("cpu", dtype=torch.bfloat16), DeferWeightGrads(store):
        y = m(x).float().square().sum()
    y.backward()
    assert len(store) == 0 and m[0].weight.grad is not None
