"""Mixture-of-experts families whose config asks for the router's auxiliary loss, trained
through real stage processes from bfloat16 sharded checkpoints, equal ``transformers`` in one
process: with one micro-batch its own ``model(...).loss``, with several each micro-batch's loss
weighted by its share of the labels (see [Note: the router's auxiliary loss] in
``pipesvc.models.hf_router``). The carried statistics cross between the stages over shared
memory and, with it off, as frames on the stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.core.loss import loss_units
from tests.integration.test_hf_families import prompts
from tests.support.hf_families import TESTED

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "olmoe")
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
STEPS = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    found = {}
    for model_type in FAMILIES:
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            model_type,
            **TESTED[model_type].config,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
        )
        directory = tmp_path_factory.mktemp(f"aux-{model_type}")
        model = AutoModelForCausalLM.from_config(config)
        model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
        found[f"aux-{model_type}"] = directory
    return found


@pytest.fixture(scope="module", params=["shm", "frames"])
def client(request: pytest.FixtureRequest, dirs: dict[str, Path]) -> Iterator[pipesvc.Client]:
    stage_args = ["--shm-bytes", "0"] if request.param == "frames" else []
    with (
        pipesvc.LocalCluster(
            num_stages=2, threads_per_stage=1, hf_models=dirs, stage_args=stage_args
        ) as cluster,
        cluster.connect() as client,
    ):
        yield client


def train_in_one_process(
    directory: Path, parts: int, steps: int = STEPS
) -> tuple[list[float], dict[str, Any]]:
    model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    total = loss_units("causal_lm", labels)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for rows in torch.arange(ids.shape[0]).chunk(parts):
            out = model(ids[rows], attention_mask=mask[rows], labels=labels[rows])
            assert out.aux_loss is not None  # the config asks for it
            weight = loss_units("causal_lm", labels[rows]) / total
            (out.loss * weight).backward()
            loss += float(out.loss.detach()) * weight
        optimizer.step()
        losses.append(loss)
    return losses, model.state_dict()


@pytest.mark.parametrize(
    ("model_type", "parts"), [(f, 2) for f in FAMILIES] + [("mixtral", 1)]
)  # fmt: skip
def test_the_router_loss_trains_as_transformers(
    client: pipesvc.Client, dirs: dict[str, Path], model_type: str, parts: int
) -> None:
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    with client.create_job(
        model=f"aux-{model_type}", loss="causal_lm", optimizer=OPTIMIZER, num_stages=2,
        num_microbatches=parts, checkpoint_every=0,
    ) as job:  # fmt: skip
        losses = [job.train_step(ids, labels, mask) for _ in range(STEPS)]
        weights = job.state_dict()
    expected_losses, expected = train_in_one_process(dirs[f"aux-{model_type}"], parts)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    assert sorted(weights) == sorted(expected)
    for key, value in weights.items():
        # atol: AdamW turns a gradient that is rounding noise into a step of up to lr * 1e-3
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=5e-5), key
