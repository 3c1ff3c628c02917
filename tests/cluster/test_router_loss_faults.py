"""The router's auxiliary loss (see [Note: carried vector] in ``pipesvc.models.carry``) through
faults: a Mixtral-shaped model trained past several periodic checkpoints while a stage dies in
backward (the carried statistics' gradient on its way back) or while a checkpoint streams, and
a spare takes its place. Every loss and every weight equals ``transformers`` in one process:
a recovery that lost, repeated or reordered a step, or restored the wrong state, fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from tests.integration.test_hf_families import prompts
from tests.integration.test_hf_router_loss import OPTIMIZER, train_in_one_process
from tests.support.faults import stage_pid
from tests.support.hf_families import TESTED

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]

STEPS = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "mixtral", **TESTED["mixtral"].config, output_router_logits=True, router_aux_loss_coef=0.5
    )
    directory = tmp_path_factory.mktemp("aux-mixtral")
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(
        directory, max_shard_size="40KB"
    )
    return directory


@pytest.mark.parametrize("fault", ["backward:5:0", "checkpoint:4:1"])
def test_a_stage_killed_mid_run_leaves_the_router_loss_exact(
    model_dir: Path, tmp_path: Path, fault: str
) -> None:
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    with (
        pipesvc.LocalCluster(
            num_stages=3,
            threads_per_stage=1,
            hf_models={"aux-mixtral": model_dir},
            stage_args=["--fault-kill", f"{fault}:{tmp_path / 'fired'}"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="aux-mixtral",
            loss="causal_lm",
            optimizer=OPTIMIZER,
            num_stages=2,
            num_microbatches=2,
            checkpoint_every=2,
        ) as job,  # fmt: skip
    ):
        rank = int(fault.split(":")[2])
        survivor = job.plan[1 - rank].address
        survivor_pid = stage_pid(survivor)
        losses = [job.train_step(ids, labels, mask) for _ in range(STEPS)]
        assert (tmp_path / "fired").exists()
        assert job.refresh().recoveries == 1
        assert stage_pid(survivor) == survivor_pid
        weights = job.state_dict()
    expected_losses, expected = train_in_one_process(model_dir, 2, steps=STEPS)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    for key, value in weights.items():
        # atol: AdamW turns a gradient that is rounding noise into a step of up to lr * 1e-3
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=5e-5), key
