"""Periodic checkpoints stream from the stages' snapshots while training goes on: each holds
exactly the state of its step, and a job resumed from it trains on like the original."""

from __future__ import annotations

from pathlib import Path

import torch

import pipesvc
from pipesvc.storage.checkpoint import read_layers, read_manifest
from tests.support.reference import PROBLEMS

ADAM = {"name": "adam", "lr": 1e-2}


def test_a_checkpoint_written_while_training_goes_on_holds_its_step(tmp_path: Path) -> None:
    problem = PROBLEMS["gpt"]
    options = {
        "model": problem.model,
        "model_args": problem.model_args,
        "num_stages": 2,
        "num_microbatches": 4,
        "optimizer": ADAM,
        "loss": problem.loss,
        "seed": 7,
    }
    batches = [problem.batch(8, seed=step) for step in range(6)]
    with (
        pipesvc.LocalCluster(num_stages=2, state_dir=tmp_path / "state") as cluster,
        cluster.connect() as client,
    ):
        # Without checkpoints: the state at step 4, and the loss of step 5.
        with client.create_job(**options, checkpoint_every=0) as plain:  # type: ignore[arg-type]
            for x, y in batches[:4]:
                plain.train_step(x, y)
            plain.save(tmp_path / "step4")
            expected_loss = plain.train_step(*batches[4])
        # Every 2 steps: step 4's checkpoint streams while steps 5 and 6 train.
        with client.create_job(**options, checkpoint_every=2) as job:  # type: ignore[arg-type]
            for x, y in batches:
                job.train_step(x, y)
            directory = tmp_path / "state" / "jobs" / job.id / "checkpoints" / "step-000000004"
            job.refresh()
            assert job.step == 6
        manifest = read_manifest(directory)
        assert manifest.step == 4
        saved = read_manifest(tmp_path / "step4")
        written = dict(read_layers(directory, manifest, 0, manifest.num_layers))
        reference = dict(read_layers(tmp_path / "step4", saved, 0, saved.num_layers))
        assert written.keys() == reference.keys() and any(".exp_avg" in k for k in written)
        for key, value in reference.items():
            assert torch.equal(written[key], value), key
        # A job resumed from it trains step 5 exactly like the job that never stopped.
        with client.create_job(**options, resume_from=directory) as resumed:  # type: ignore[arg-type]
            assert resumed.step == 4
            assert resumed.train_step(*batches[4]) == expected_loss
