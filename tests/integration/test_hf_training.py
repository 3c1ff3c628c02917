"""Hugging Face models trained through real stage processes equal transformers' model trained
in one process: causal-LM loss over padded batches split unevenly, AdamW, both schedules."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.core.loss import IGNORE_INDEX
from pipesvc.models.hf import hf_layer_specs, stored_names
from pipesvc.models.hf_checkpoint import Checkpoint

VOCAB = 48
FAMILIES = {
    # grouped-query attention
    "hf-llama": ("llama", {"num_key_value_heads": 2}),
    # a head stored under an older name, biases, parallel attention and MLP
    "hf-neox": ("gpt_neox", {}),
    # one block: over three stages each layer is a stage, and with LoRA the first (the
    # embedding) has nothing to train
    "hf-tiny": ("llama", {"num_key_value_heads": 2, "num_hidden_layers": 1}),
}
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
# eps 1e-6, not 1e-8: a key bias's gradient is zero in exact arithmetic (softmax ignores a
# shift shared by all keys), so in floating point it is rounding noise of ~1e-10, which Adam
# with eps 1e-8 turns into updates of up to lr whose sign depends on the order of sums.
STEPS = 3


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, (model_type, extra) in FAMILIES.items():
        torch.manual_seed(0)
        sizes = {
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 32,
        }  # fmt: skip
        config = AutoConfig.for_model(model_type, **{**sizes, **extra})
        directory = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="30KB")
        dirs[name] = directory
    return dirs


@pytest.fixture(scope="module")
def hf_client(hf_dirs: dict[str, Path]) -> Iterator[pipesvc.Client]:
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1, hf_models=hf_dirs) as cluster,
        pipesvc.connect(cluster.address, timeout_s=120) as client,
    ):
        yield client


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """7 rows of 10 tokens; rows padded unevenly at the end (labels -100 there)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (7, 10), generator=g)
    labels = ids.clone()
    for row in range(7):
        labels[row, 10 - (row * (step + 1)) % 7 :] = IGNORE_INDEX
    return ids, labels


def reference_run(directory: Path) -> tuple[list[float], Any]:
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step)
        optimizer.zero_grad()
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize(
    ("name", "schedule", "num_stages"),
    [("hf-llama", "1f1b", 3), ("hf-llama", "gpipe", 2), ("hf-neox", "gpipe", 3),
     ("hf-neox", "1f1b", 2)],
)  # fmt: skip
def test_training_equals_transformers_in_one_process(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path], name: str, schedule: str, num_stages: int
) -> None:
    job = hf_client.create_job(
        model=name,
        loss="causal_lm",
        optimizer=OPTIMIZER,
        schedule=schedule,
        num_stages=num_stages,
        num_microbatches=3,
        input_shape=[3, 10],
        input_dtype="int64",
        checkpoint_every=2,
    )
    try:
        losses = [job.train_step(*batch(step)) for step in range(STEPS)]
        expected_losses, reference = reference_run(hf_dirs[name])
        assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
        ids, _ = batch(99)
        reference.eval()
        with torch.no_grad():
            expected_logits = reference(ids).logits
        assert torch.allclose(job.forward(ids), expected_logits, rtol=1e-4, atol=1e-5)
        weights = hf_keyed(job.state_dict(), hf_dirs[name])
        expected = reference.state_dict()
        assert sorted(weights) == sorted(expected)
        for key, value in weights.items():
            assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key
    finally:
        job.close()


def hf_keyed(
    state: dict[str, torch.Tensor], directory: Path, lora: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """``{layer}.{param}`` keys -> the Hugging Face model's own keys."""
    ckpt = Checkpoint(directory)
    specs = hf_layer_specs(directory, lora)
    out = {}
    for index, spec in enumerate(specs):
        with torch.device("meta"):
            layer = copy.deepcopy(spec.build())
        for local, stored in stored_names(ckpt, index, layer).items():
            hf_name = stored.replace("embed_out.", "lm_head.")
            out[hf_name] = state[f"{index}.{local}"]
    return out


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(
    ("name", "schedule", "partition"),
    [("hf-llama", "1f1b", "parameters"), ("hf-llama", "gpipe", "parameters"),
     ("hf-tiny", "1f1b", "uniform")],
)  # fmt: skip
def test_lora_training_equals_peft_in_one_process(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path], name: str, schedule: str, partition: str
) -> None:
    from peft import LoraConfig, get_peft_model

    blocks = AutoConfig.from_pretrained(hf_dirs[name]).num_hidden_layers
    job = hf_client.create_job(
        model=name,
        partition=partition,
        model_args={"lora": LORA},
        loss="causal_lm",
        optimizer=OPTIMIZER,
        schedule=schedule,
        num_stages=3,
        num_microbatches=3,
        input_shape=[3, 10],
        input_dtype="int64",
        checkpoint_every=2,
    )
    try:
        initial = hf_keyed(job.state_dict(), hf_dirs[name], LORA)
        losses = [job.train_step(*batch(step)) for step in range(STEPS)]
        final = hf_keyed(job.state_dict(), hf_dirs[name], LORA)
    finally:
        job.close()
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(hf_dirs[name]),
        LoraConfig(**LORA),  # type: ignore[arg-type]
    )
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, value in initial.items():
            params[f"base_model.model.{name}"].copy_(value)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1, eps=1e-6)
    expected_losses = []
    for step in range(STEPS):
        ids, labels = batch(step)
        optimizer.zero_grad()
        loss = reference(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        expected_losses.append(loss.item())
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    changed = 0
    for name, value in final.items():
        expected = params[f"base_model.model.{name}"]
        assert torch.allclose(value, expected, rtol=1e-4, atol=1e-5), name
        if "lora_" in name:
            changed += not torch.equal(value, initial[name])
        else:
            assert torch.equal(value, initial[name]), name  # frozen
    assert changed == 4 * blocks  # lora_A and lora_B of q_proj and v_proj, in each block
