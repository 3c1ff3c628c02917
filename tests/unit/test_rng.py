"""Dropout in StageRuntime: seeded per (seed, step, micro-batch, layer), eval mode for inference,
and batch statistics refused under micro-batching; against one-process torch."""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesvc import models
from pipesvc.core.config import JobConfig
from pipesvc.errors import InvalidArgumentError
from pipesvc.models import registry
from pipesvc.stage.compute import layer_calls
from pipesvc.stage.compute.runtime import StageRuntime

GPT_ARGS = {
    "vocab_size": 17,
    "block_size": 8,
    "embed_dim": 16,
    "num_heads": 2,
    "num_blocks": 2,
    "dropout": 0.3,
}
NUM_LAYERS = 4
SEED = 5
NUM_MICROBATCHES = 3
OPTIMIZER = {"name": "adamw", "lr": 1e-2}


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    with registry._FACTORIES.scratch():
        yield


def _config(**overrides: object) -> JobConfig:
    fields: dict[str, object] = {
        "model": "gpt",
        "model_args": GPT_ARGS,
        "seed": SEED,
        "num_stages": 2,
        "num_microbatches": NUM_MICROBATCHES,
        "optimizer": OPTIMIZER,
        "loss": "cross_entropy",
        **overrides,
    }
    return JobConfig(**fields)  # type: ignore[arg-type]


def _stages(config: JobConfig, bounds: list[int]) -> list[StageRuntime]:
    return [
        StageRuntime(
            config=config,
            start_layer=start,
            end_layer=end,
            rank=rank,
            num_stages=len(bounds) - 1,
            device=torch.device("cpu"),
        )
        for rank, (start, end) in enumerate(itertools.pairwise(bounds))
    ]


def _batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randint(0, 17, (2, 8), generator=g), torch.randint(0, 17, (2, 8), generator=g))
        for _ in range(NUM_MICROBATCHES)
    ]


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _pipelined_step(stages: list[StageRuntime], step: int, *, interleave: bool) -> float:
    """One step over the stages: all forwards then all backwards (gpipe), or each micro-batch's
    backward right after its forward (as 1F1B does on the last stage); the global generators
    are reseeded between forward and backward, which must not matter."""
    for rt in stages:
        rt.begin_run(True)
    total = 0.0

    def forward(mb: int, x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal total
        for rt in stages:
            x = rt.forward(mb, x, training=True)
        total += float(stages[-1].loss(mb, y, 1 / NUM_MICROBATCHES).detach())

    def backward(mb: int) -> None:
        torch.manual_seed(12345 + mb)  # backward must draw nothing
        grad = None
        for rt in reversed(stages):
            grad = rt.backward(mb, grad)

    batch = _batch(step)
    for mb, (x, y) in enumerate(batch):
        forward(mb, x, y)
        if interleave:
            backward(mb)
    if not interleave:
        for mb in reversed(range(NUM_MICROBATCHES)):
            backward(mb)
    for rt in stages:
        rt.grad_norm_sq()
        rt.commit(None)
    return total


@pytest.mark.parametrize(("bounds", "interleave"), [([0, 2, 4], False), ([0, 1, 3, 4], True)])
def test_pipelined_dropout_training_equals_seeded_one_process_training(
    bounds: list[int], interleave: bool
) -> None:
    stages = _stages(_config(num_stages=len(bounds) - 1), bounds)
    model = models.build("gpt", seed=SEED, **GPT_ARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 4):
        loss = _pipelined_step(stages, step - 1, interleave=interleave)
        opt.zero_grad(set_to_none=True)
        expected = 0.0
        for mb, (x, y) in enumerate(_batch(step - 1)):
            out = models.seeded_forward(model, x, seed=SEED, step=step, microbatch=mb)
            part = _ce(out, y) / NUM_MICROBATCHES
            part.backward()
            expected += float(part.detach())
        opt.step()
        assert loss == pytest.approx(expected, rel=1e-6)
        weights = {k: v for rt in stages for k, v in rt.tensors("parameters").items()}
        for key, value in model.state_dict().items():
            torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)


def test_dropout_is_active_and_each_call_gets_its_own_masks() -> None:
    (rt,) = _stages(_config(num_stages=1), [0, NUM_LAYERS])
    x, _ = _batch(0)[0]
    rt.begin_run(True)
    first = rt.forward(0, x, training=True)
    second = rt.forward(1, x, training=True)
    rt.abort()
    rt.begin_run(False)
    plain = rt.forward(0, x, training=False)
    assert not torch.allclose(first, second)  # micro-batches draw different masks
    assert not torch.allclose(first, plain)


def test_a_replayed_step_draws_the_masks_of_its_first_attempt() -> None:
    config = _config(num_stages=1)
    (rt,) = _stages(config, [0, NUM_LAYERS])
    _pipelined_step([rt], 0, interleave=True)
    saved = {k: v.clone() for k, v in rt.tensors("checkpoint").items()}
    x, _ = _batch(1)[2]
    rt.begin_run(True)
    torch.manual_seed(1)
    first = rt.forward(2, x, training=True).detach()
    rt.abort()  # the step failed somewhere; it is run again
    rt.begin_run(True)
    torch.manual_seed(2)
    again = rt.forward(2, x, training=True).detach()
    rt.abort()
    # Recovery: a fresh stage restored from the checkpoint of step 1 replays step 2.
    (fresh,) = _stages(config, [0, NUM_LAYERS])
    fresh.load_state(fresh.check_state(saved), step=1)
    fresh.begin_run(True)
    replayed = fresh.forward(2, x, training=True).detach()
    assert torch.equal(first, again)
    assert torch.equal(first, replayed)


def test_inference_runs_in_eval_mode_and_training_returns_to_train_mode() -> None:
    config = _config(num_stages=1, model_args={**GPT_ARGS, "dropout": 0.5})
    (rt,) = _stages(config, [0, NUM_LAYERS])
    model = models.build("gpt", seed=SEED, **{**GPT_ARGS, "dropout": 0.5}).eval()
    x, _ = _batch(0)[0]
    with torch.no_grad():
        expected = model(x)
    rt.begin_run(False)
    first = rt.forward(0, x, training=False)
    second = rt.forward(1, x, training=False)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    rt.begin_run(True)
    trained = rt.forward(0, x, training=True)
    assert all(m.training for m in rt.module.modules())
    assert not torch.allclose(trained, expected)
    rt.abort()
    rt.begin_run(False)
    assert torch.equal(rt.forward(0, x, training=False), expected)


def test_only_layers_that_draw_random_numbers_are_seeded() -> None:
    layers = models.build("gpt", seed=0, **GPT_ARGS)
    assert [models.uses_rng(layer) for layer in layers] == [True, True, True, False]
    plain = models.build("gpt", seed=0, **{**GPT_ARGS, "dropout": 0.0})
    assert not any(models.uses_rng(layer) for layer in plain)
    assert not models.uses_rng(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))
    assert models.uses_rng(nn.Sequential(nn.Linear(2, 2), nn.Dropout2d(0.1)))
    assert models.uses_rng(nn.TransformerEncoderLayer(8, 2, dropout=0.1))
    assert models.uses_rng(nn.RReLU())
    marked = nn.Linear(2, 2)
    marked.uses_rng = True  # type: ignore[assignment]
    assert models.uses_rng(nn.Sequential(marked))


def test_only_stochastic_layers_run_under_their_seed_and_match_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each layer's call plan is fixed when it is built: a training forward seeds the layers
    with dropout, once per micro-batch and under their own index, and calls the others with no
    generator touched; an inference forward seeds nothing. The outputs are the seeded
    reference's, bit for bit."""
    seeded: list[tuple[int, int, int]] = []
    real = models.layer_rng

    def counting(
        seed: int, step: int, microbatch: int, layer: int, device: object = None
    ) -> contextlib.AbstractContextManager[None]:
        seeded.append((step, microbatch, layer))
        return real(seed, step, microbatch, layer, device)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_calls, "layer_rng", counting)
    (rt,) = _stages(_config(num_stages=1), [0, NUM_LAYERS])
    model = models.build("gpt", seed=SEED, **GPT_ARGS)
    stochastic = [i for i, layer in enumerate(model) if models.uses_rng(layer)]
    assert 0 < len(stochastic) < NUM_LAYERS  # both kinds are there
    rt.begin_run(True)
    for mb, (x, _) in enumerate(_batch(0)):
        out = rt.forward(mb, x, training=True)
        monkeypatch.setattr(layer_calls, "layer_rng", real)
        expected = models.seeded_forward(model, x, seed=SEED, step=1, microbatch=mb)
        monkeypatch.setattr(layer_calls, "layer_rng", counting)
        assert torch.equal(out, expected)
    rt.abort()
    assert seeded == [(1, mb, i) for mb in range(NUM_MICROBATCHES) for i in stochastic]
    seeded.clear()
    rt.begin_run(False)
    rt.forward(0, _batch(0)[0][0], training=False)
    assert seeded == []


def test_layer_rng_is_stable_and_leaves_the_global_generator_as_it_was() -> None:
    assert models.dropout_seed(0, 1, 0, 0) == models.dropout_seed(0, 1, 0, 0)
    seeds = {
        models.dropout_seed(s, t, m, i)
        for s in range(2)
        for t in range(2)
        for m in range(2)
        for i in range(2)
    }
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert models.dropout_seed(0, 1, 0, 0) == 3994045931247821817
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with models.layer_rng(7, 1, 2, 3):
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)
    with models.layer_rng(7, 1, 2, 3):
        assert torch.equal(torch.rand(4), inside)


def _batchnorm_model() -> list[models.LayerSpec]:
    return [
        models.LayerSpec(nn.Linear, 4, 4),
        models.LayerSpec(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))),
        models.LayerSpec(nn.Linear, 4, 2),
    ]


@pytest.mark.usefixtures("isolated_registry")
def test_batch_statistics_are_refused_with_several_microbatches() -> None:
    models.register_model("bn-test")(_batchnorm_model)
    config = _config(model="bn-test", model_args={}, loss="mse", num_microbatches=2)
    with pytest.raises(InvalidArgumentError, match=r"layer 1 \(Sequential\).*1: BatchNorm1d"):
        _stages(config, [0, 2, 3])
    _stages(config, [2, 3])  # a stage without that layer is fine
    (rt,) = _stages(_config(model="bn-test", model_args={}, loss="mse", num_microbatches=1), [0, 3])
    model = copy.deepcopy(rt.module)
    x = torch.randn(6, 4)
    rt.begin_run(True)
    out = rt.forward(0, x, training=True)
    expected = x
    for layer in model.values():
        expected = layer(expected)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    tracked = nn.InstanceNorm1d(4, track_running_stats=True)
    assert models.batch_statistics(nn.Sequential(nn.Linear(4, 4), tracked)) == ["1: InstanceNorm1d"]
    assert models.batch_statistics(nn.Sequential(nn.GroupNorm(2, 4), nn.LayerNorm(4))) == []
