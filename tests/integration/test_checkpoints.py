"""Checkpoints a user takes: job.save(path), and resuming under another plan; periodic
checkpoints of models with parameter-free layers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.param_free import MODELS_MODULE, PARAM_FREE, Training
from tests.support.reference import PROBLEMS, Reference

GPT = PROBLEMS["gpt"]
OPTIMIZER = {"name": "adamw", "lr": 1e-2}


def _job(client: pipesvc.Client, num_stages: int, **extra: object) -> pipesvc.Job:
    return client.create_job(
        model="gpt",
        model_args=GPT.model_args,
        seed=5,
        num_stages=num_stages,
        num_microbatches=2,
        optimizer=OPTIMIZER,
        loss=GPT.loss,
        **extra,  # type: ignore[arg-type]
    )


def test_save_and_resume_under_another_plan(client: pipesvc.Client, tmp_path: Path) -> None:
    reference = Reference(GPT, seed=5, optimizer=OPTIMIZER, clip_grad_norm=None)
    with _job(client, 2) as job:
        for step in range(2):
            x, y = GPT.batch(6, seed=step)
            job.train_step(x, y)
            reference.step(x, y)
        job.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["num_layers"] == 4
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())
    # Resume on 3 stages (another plan): weights, Adam state and the step count carry over.
    with _job(client, 3, resume_from=tmp_path / "ckpt") as resumed:
        assert resumed.step == 2 and len(resumed.plan) == 3
        for step in range(2, 4):
            x, y = GPT.batch(6, seed=step)
            loss = resumed.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y), rel=1e-5)
        assert resumed.step == 4
        weights = resumed.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5)


def test_resume_refuses_another_model_and_a_tampered_file(
    client: pipesvc.Client, tmp_path: Path
) -> None:
    with _job(client, 2) as job:
        job.save(tmp_path / "ckpt")
    with pytest.raises(pipesvc.InvalidArgumentError, match="model_args"):
        client.create_job(
            model="gpt",
            model_args={**GPT.model_args, "num_blocks": 3},
            num_stages=2,
            resume_from=tmp_path / "ckpt",
        )
    layer_file = sorted((tmp_path / "ckpt").glob("layer-*.safetensors"))[0]
    data = bytearray(layer_file.read_bytes())
    data[-1] ^= 0xFF
    layer_file.write_bytes(bytes(data))
    with pytest.raises(pipesvc.InvalidArgumentError, match="SHA-256"):
        _job(client, 2, resume_from=tmp_path / "ckpt")
    assert all(not s.job_id for s in client.stages())  # the failed resume freed its stages


@pytest.fixture(scope="module")
def param_free_client() -> Iterator[pipesvc.Client]:
    """Three stages that can also build relu-mlp."""
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1, models=[MODELS_MODULE]) as cluster,
        cluster.connect(timeout_s=120) as connected,
    ):
        yield connected


@pytest.mark.parametrize("model", sorted(PARAM_FREE))
def test_parameter_free_layers_checkpoint_save_and_resume(
    param_free_client: pipesvc.Client, model: str, tmp_path: Path
) -> None:
    """Five steps pass the periodic checkpoints at steps 2 and 4; the saved checkpoint covers
    every layer and resumes under another plan."""
    training = Training.start(param_free_client, model, num_stages=2)
    with training.job as job:
        for _ in range(5):
            training.step()
        training.check_weights()
        job.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    num_layers = manifest["num_layers"]
    assert manifest["step"] == 5
    assert manifest["covers"] == {"start_layer": 0, "end_layer": num_layers}
    with_tensors = sorted({int(k.split(".")[0]) for k in training.reference.model.state_dict()})
    assert sorted(int(k) for k in manifest["files"]) == with_tensors
    assert len(with_tensors) < num_layers  # some layer really has no tensors
    resumed = Training.start(param_free_client, model, num_stages=3, resume_from=tmp_path / "ckpt")
    resumed.reference = training.reference
    with resumed.job as job:
        assert job.step == 5 and len(job.plan) == 3
        for _ in range(2):
            resumed.step()
        resumed.check_weights()
