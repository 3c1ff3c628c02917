"""Every tested family (``tests/support/hf_families.py``) through real stage processes equals
``transformers`` in one process: two AdamW steps on left-padded prompts, greedy generation
after them, and the export, from checkpoints stored as published ones are (bfloat16, sharded)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.models.hf_cache import cache_layout
from pipesvc.models.hf_checkpoint import Checkpoint
from tests.support.hf_families import TESTED, VOCAB

OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
STEPS = 2
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    found = {}
    for model_type, family in TESTED.items():
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **family.config)
        directory = tmp_path_factory.mktemp(model_type)
        model = AutoModelForCausalLM.from_config(config)
        model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
        found[f"fam-{model_type}"] = directory
    return found


@pytest.fixture(scope="module")
def client(dirs: dict[str, Path]) -> Iterator[pipesvc.Client]:
    with (
        pipesvc.LocalCluster(num_stages=2, threads_per_stage=1, hf_models=dirs) as cluster,
        cluster.connect() as client,
    ):
        yield client


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of 7, 4, 6 and 2 tokens, left-padded to 7, with their mask."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (4, 7), generator=g)
    mask = torch.ones(4, 7, dtype=torch.long)
    for row, length in enumerate([7, 4, 6, 2]):
        mask[row, : 7 - length] = 0
        ids[row, : 7 - length] = 0
    return ids, mask


def train_in_one_process(directory: Path) -> tuple[list[float], Any]:
    model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.eval()


@pytest.mark.parametrize("model_type", list(TESTED))
def test_a_family_trains_generates_and_exports_as_transformers(
    client: pipesvc.Client, dirs: dict[str, Path], model_type: str, tmp_path: Path
) -> None:
    directory = dirs[f"fam-{model_type}"]
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    # Where every layer attends to every earlier position, the rows' caches stack and each
    # generation step runs as one micro-batch (fused), and the decode steps after the prompt's
    # run go in one run of 4 (see [Note: decode steps on the stages]); windows, chunks and
    # recurrent states do not line up across rows, so those steps keep their two parts, a
    # run each.
    fused = cache_layout(str(directory.resolve())) is not None
    expected = [[0], [0] * (NEW_TOKENS - 1)] if fused else [[0, 1]] * NEW_TOKENS
    with client.create_job(
        model=f"fam-{model_type}", loss="causal_lm", optimizer=OPTIMIZER, num_stages=2,
        num_microbatches=2, checkpoint_every=0,
    ) as job:  # fmt: skip
        losses = [job.train_step(ids, labels, mask) for _ in range(STEPS)]
        weights = job.state_dict()
        generated = job.generate(ids, NEW_TOKENS, attention_mask=mask)
        timelines = job.timelines(max_runs=len(expected))
        job.save_pretrained(tmp_path / "out", max_shard_size="40KB")
    for timeline in timelines:
        forwards = [e for e in timeline.events if e.name == "forward"]
        runs = sorted({e.run_id for e in forwards})
        per_run = [sorted(e.microbatch for e in forwards if e.run_id == r) for r in runs]
        assert per_run == expected, model_type
    expected_losses, reference = train_in_one_process(directory)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    expected = reference.state_dict()
    assert sorted(weights) == sorted(expected)
    for key, value in weights.items():
        # atol: AdamW turns a gradient that is rounding noise into a step of up to lr * 1e-3
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=5e-5), key
    # Greedy tokens after training equal transformers' generate on the job's weights.
    reference.load_state_dict(weights)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    with torch.no_grad():
        tokens = reference.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert torch.equal(generated, tokens)
    # The export holds the tensors under the names save_pretrained writes, in the stored
    # dtype, and loads back to the job's weights (a router transformers keeps in float32 is
    # upcast again on load).
    out = tmp_path / "out"
    assert set(Checkpoint(directory).files) <= set(Checkpoint(out).files)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, weights[key].bfloat16().to(value.dtype)), key
