"""The router's auxiliary loss of mixture-of-experts models across stages (see [Note: the
router's auxiliary loss] in ``pipesvc.models.hf_router``): the carried sums give
``transformers``' loss, the engines of every schedule train like ``transformers`` micro-batch by
micro-batch, and a family computing it otherwise is refused at registration."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipesvc.core import microbatch, schedule
from pipesvc.core.loss import loss_units
from pipesvc.core.microbatch import RunBatch
from pipesvc.errors import InvalidArgumentError
from pipesvc.models import registry
from pipesvc.models.carry import Carry, CarrySpec, check_carried
from pipesvc.models.hf import register_hf_model
from pipesvc.models.hf_router import RouterLoss, aux_loss, router_loss_of, statistics
from pipesvc.stage.compute.engine import RunResult
from tests.support.hf_families import TESTED, VOCAB
from tests.support.pipeline import Pipeline
from tests.support.reference import Problem

COEF = 0.5


def save_moe(model_type: str, directory: Path, **extra: Any) -> Any:
    """A small model of ``model_type`` whose config asks for the router's auxiliary loss."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        **TESTED[model_type].config,
        output_router_logits=True,
        router_aux_loss_coef=COEF,
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return model


def test_the_carried_sums_give_transformers_load_balancing_loss() -> None:
    from transformers.models.mixtral import modeling_mixtral

    experts, top_k = 5, 2
    loss = RouterLoss(experts, top_k, COEF, torch.nn.Linear, 0)
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(12, experts, generator=g) for _ in range(4)]
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[0, :2] = 0
    for given in (None, mask):
        total = torch.zeros(loss.size)
        for layer in layers:  # as stages add them: layer after layer from zeros
            total = total + statistics(loss, layer, given)
        expected = modeling_mixtral.load_balancing_loss_func(tuple(layers), experts, top_k, given)
        assert torch.equal(aux_loss(loss, total), COEF * expected)
    # The rows counted: every (layer, token) pair, or only the unpadded ones.
    assert float(total[-1]) == 4 * int(mask.sum())


def test_a_carried_vector_of_another_size_is_refused() -> None:
    spec = CarrySpec(size=3, loss=torch.sum)
    check_carried(torch.zeros(3), spec, "the vector")
    with pytest.raises(InvalidArgumentError, match=r"the vector has shape \[4\].*vector of 3"):
        check_carried(torch.zeros(4), spec, "the vector")
    with pytest.raises(InvalidArgumentError, match="float64"):
        check_carried(torch.zeros(3, dtype=torch.float64), spec, "the vector")
    carry = Carry(torch.zeros(3))
    carry.add(torch.ones(3))
    assert torch.equal(carry.value, torch.ones(3))


def test_a_config_without_the_loss_carries_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", **TESTED["mixtral"].config)
    assert router_loss_of(AutoModelForCausalLM.from_config(config), "x") is None
    config.output_router_logits, config.router_aux_loss_coef = True, 0.0
    assert router_loss_of(AutoModelForCausalLM.from_config(config), "x") is None


def test_a_family_computing_the_loss_otherwise_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_moe("mixtral", tmp_path)
    module = sys.modules[type(AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(tmp_path))).__module__]  # fmt: skip
    squared = module.load_balancing_loss_func

    def otherwise(*args: Any) -> Any:
        return squared(*args) ** 2

    monkeypatch.setattr(module, "load_balancing_loss_func", otherwise)
    with pytest.raises(InvalidArgumentError, match="load_balancing_loss_func gives"):
        register_hf_model("hf-router-otherwise", tmp_path)
    assert "hf-router-otherwise" not in registry.known_models()


def test_a_family_recording_no_router_logits_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = save_moe("mixtral", tmp_path)
    monkeypatch.setattr(type(model), "_can_record_outputs", {})
    with pytest.raises(InvalidArgumentError, match="does not record router logits"):
        register_hf_model("hf-router-unrecorded", tmp_path)
    assert "hf-router-unrecorded" not in registry.known_models()


def _reference_step(
    directory: Path, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, parts: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """``transformers`` in one process, micro-batch by micro-batch, each micro-batch's loss
    weighted by its share of the labels: the loss and the gradients by name."""
    model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()
    total = loss_units("causal_lm", labels)
    loss = 0.0
    for rows in torch.arange(ids.shape[0]).chunk(parts):
        out = model(ids[rows], attention_mask=mask[rows], labels=labels[rows])
        weight = loss_units("causal_lm", labels[rows]) / total
        (out.loss * weight).backward()
        loss += float(out.loss.detach()) * weight
    return loss, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule_name", schedule.schedule_names())
def test_engines_of_every_schedule_train_with_the_router_loss_as_transformers(
    tmp_path: Path, schedule_name: str
) -> None:
    """Two stages (interleaved: two layer ranges each), two micro-batches: the loss and every
    gradient equal ``transformers``' micro-batch by micro-batch, so the carried statistics and
    their gradients crossed every stage boundary in both directions."""
    save_moe("mixtral", tmp_path)  # two decoder layers: one per stage, or per range
    name = f"hf-router-{schedule_name}"
    register_hf_model(name, tmp_path)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (4, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # padding the loss must leave out, in one row of each micro-batch
    mask[3, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    assert loss_units("causal_lm", labels[:2]) == loss_units("causal_lm", labels[2:])
    problem = Problem(model=name, model_args={}, loss="causal_lm", input_shape=tuple(ids.shape))
    pipeline = Pipeline(
        problem,
        schedule_name=schedule_name,
        num_stages=2,
        seed=0,
        optimizer={"name": "sgd", "lr": 0.1},
        clip_grad_norm=None,
        num_microbatches=2,
    )
    assert all(e.runtime.features.carry is not None for e in pipeline.engines)
    batch = RunBatch.split(ids, labels, {"attention_mask": mask}, 2)
    assert [len(t) for t in batch.inputs] == [2, 2]
    assert microbatch.loss_weights([2, 2]) == [0.5, 0.5]  # the weights the pipeline uses
    results = pipeline.run_batch(batch, run_id=1)
    assert all(isinstance(r, RunResult) for r in results), results
    last = results[-1]
    assert isinstance(last, RunResult)
    expected_loss, expected_grads = _reference_step(tmp_path, ids, mask, labels, 2)
    assert sum(last.losses) == pytest.approx(expected_loss, rel=1e-6)
    for engine in pipeline.engines:
        engine.commit(1, None)
    keys = registry.model_export(name, {})["keys"]  # type: ignore[index]
    grads = {keys[k]: v for k, v in pipeline.tensors("gradients").items()}  # type: ignore[index]
    assert sorted(grads) == sorted(expected_grads)
    for key, value in expected_grads.items():
        torch.testing.assert_close(grads[key], value, rtol=1e-5, atol=1e-7, msg=key)
    # Without the router loss the routers' gradients differ: the test sees the carried term.
    plain = tmp_path / "plain"
    config = json.loads((tmp_path / "config.json").read_text())
    plain.mkdir()
    for file in tmp_path.glob("*.safetensors"):
        (plain / file.name).symlink_to(file)
    (plain / "config.json").write_text(json.dumps({**config, "output_router_logits": False}))
    _, without = _reference_step(plain, ids, mask, labels, 2)
    router = next(k for k in without if "gate" in k and "experts" not in k)
    assert not torch.allclose(without[router], expected_grads[router], rtol=1e-3)
