"""Unit tests of StageRuntime's gradient buffers, against plain torch training."""

from __future__ import annotations

import copy

import pytest
import torch

from pipesvc import models
from pipesvc.core.config import JobConfig
from pipesvc.stage.compute.runtime import StageRuntime
from pipesvc.stage.dataplane import malloc
from pipesvc.stage.dataplane.malloc import STAGE_GLIBC_TUNABLES, stage_environ

ARGS = {"in_features": 6, "hidden_features": 10, "out_features": 3, "num_layers": 4}
NUM_MICROBATCHES = 3


def _runtime(optimizer: dict[str, object]) -> StageRuntime:
    config = JobConfig(model="mlp", model_args=ARGS, num_stages=1, optimizer=optimizer, loss="mse")
    return StageRuntime(
        config=config,
        start_layer=0,
        end_layer=len(models.layer_specs("mlp", ARGS)),
        rank=0,
        num_stages=1,
        device=torch.device("cpu"),
    )


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [
        (torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
        for _ in range(NUM_MICROBATCHES)
    ]


def _train_step(rt: StageRuntime, step: int) -> None:
    rt.begin_run(True)
    for mb, (x, y) in enumerate(_batches(step)):
        rt.forward(mb, x, training=True)
        rt.loss(mb, y, 1 / NUM_MICROBATCHES)
        rt.backward(mb, None)
    rt.grad_norm_sq()
    rt.commit(None)


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "adam", "lr": 1e-2},
        {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        {"name": "sgd", "lr": 1e-2, "momentum": 0.9},
    ],
)
def test_steps_match_torch_bitwise_and_reuse_gradient_buffers(
    optimizer: dict[str, object],
) -> None:
    rt = _runtime(optimizer)
    model = copy.deepcopy(rt.module)
    kwargs = {k: v for k, v in optimizer.items() if k != "name"}
    opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[
        str(optimizer["name"])
    ](model.parameters(), **kwargs)
    buffers: dict[str, int] = {}
    for step in range(3):
        _train_step(rt, step)
        opt.zero_grad(set_to_none=True)
        for x, y in _batches(step):
            out = x
            for layer in model.values():
                out = layer(out)
            torch.autograd.backward(torch.nn.functional.mse_loss(out, y) / NUM_MICROBATCHES)
        opt.step()
        for (name, p), q in zip(rt.module.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q), (step, name)
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad), (step, name)
            if step == 0:
                buffers[name] = p.grad.data_ptr()
            else:
                assert p.grad.data_ptr() == buffers[name], name  # zeroed, not reallocated


def test_a_parameter_without_gradient_in_a_run_ends_it_with_none() -> None:
    rt = _runtime({"name": "adam", "lr": 1e-2})
    _train_step(rt, 0)
    frozen = dict(rt.module.named_parameters())["0.0.weight"]
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    _train_step(rt, 1)
    assert frozen.grad is None
    assert torch.equal(frozen, before)  # the optimizer skipped it, as after set_to_none
    assert "0.0.weight" not in rt.tensors("gradients")
    assert "0.0.bias" in rt.tensors("gradients")


def test_abort_drops_the_gradients() -> None:
    rt = _runtime({"name": "sgd", "lr": 1e-2})
    _train_step(rt, 0)
    rt.begin_run(True)
    x, _ = _batches(1)[0]
    rt.forward(0, x, training=True)
    rt.abort()
    assert all(p.grad is None for p in rt.module.parameters())
    assert rt.tensors("gradients") == {}


def test_stage_environ_adds_the_malloc_tunables_once() -> None:
    assert stage_environ({})["GLIBC_TUNABLES"] == STAGE_GLIBC_TUNABLES
    env = stage_environ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "X": "1"})
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.hugetlb=1:{STAGE_GLIBC_TUNABLES}", "X": "1"}
    own = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}
    assert stage_environ(own) == own


def test_malloc_settings_leave_those_the_environment_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    applied: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(malloc, "_apply", lambda settings: applied.append(list(settings)))
    malloc.tune_malloc(1 << 20, environ={})
    malloc.tune_malloc(1 << 20, environ={"MALLOC_MMAP_THRESHOLD_": "65536"})
    malloc.tune_malloc(1 << 20, environ={"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
    malloc.single_arena(environ={})
    malloc.single_arena(environ={"MALLOC_ARENA_MAX": "2"})
    every = [(-3, 1 << 20), (-1, 1 << 20), (-8, 1)]  # mmap and trim thresholds, arena count
    assert applied == [every, every[1:], every[:2], every[2:], []]
