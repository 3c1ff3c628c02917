"""Deferred weight gradients: B leaves the linear layers' weight gradients, W adds them."""

from __future__ import annotations

import torch

from pipesvc.stage.compute.weight_grads import DeferWeightGrads, WeightGradStore


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


def computed_weights_model() -> torch.nn.Module:
    """Linear layers whose weights or biases are computed from parameters: weight_norm,
    spectral_norm, and MultiheadAttention's projections cut out of packed ones."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.normed = weight_norm(torch.nn.Linear(4, 6))
            self.spectral = spectral_norm(torch.nn.Linear(6, 6))
            self.kv = torch.nn.MultiheadAttention(6, 2, kdim=3, vdim=5, batch_first=True)
            self.cross = torch.nn.MultiheadAttention(6, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.spectral(self.normed(x).tanh())
            k, v = x[..., :3], torch.cat([x, x[..., :1]], -1)
            h = h + self.kv(h, k, v, need_weights=False)[0]
            return h + self.cross(h, h.flip(1), h.flip(1), need_weights=False)[0]

    torch.manual_seed(0)
    return Block().eval()  # eval: spectral_norm's power iteration does not move its vectors


def test_computed_weights_get_their_gradients_through_autograd() -> None:
    m, x = computed_weights_model(), torch.randn(2, 5, 4, requires_grad=True)
    expected = fused_grads(m, x)
    expected_x = torch.autograd.grad(m(x).square().sum(), x)[0]
    store = WeightGradStore()
    with DeferWeightGrads(store):
        y = m(x).square().sum()
    x.grad = None
    y.backward()
    # weight_norm's and spectral_norm's linears; MultiheadAttention's functional form runs whole
    # (torch calls a mode's handler with the mode off, so it sees no linear inside).
    assert len(store) == 2
    assert m.normed.parametrizations.weight.original0.grad is None  # left for W
    torch.testing.assert_close(x.grad, expected_x)
    store.apply()
    assert set(expected) == {k for k, p in m.named_parameters() if p.grad is not None}
    for key, p in m.named_parameters():
        torch.testing.assert_close(p.grad, expected[key], rtol=1e-5, atol=1e-6)


def test_a_weight_computed_from_the_input_is_not_deferred() -> None:
    """Its gradient also flows to the input, which B must send whole."""
    torch.manual_seed(0)
    base = torch.nn.Parameter(torch.randn(3, 4))

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = base * x.mean()  # a hypernetwork's weight
        return torch.nn.functional.linear(x, weight)

    x = torch.randn(5, 4, requires_grad=True)
    expected_x, expected_base = torch.autograd.grad(forward(x).square().sum(), (x, base))
    store = WeightGradStore()
    with DeferWeightGrads(store):
        y = forward(x).square().sum()
    y.backward()
    store.apply()
    assert len(store) == 0
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(base.grad, expected_base)
