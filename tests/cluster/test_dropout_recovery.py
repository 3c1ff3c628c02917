"""A killed stage costs a job with dropout no committed work either: recovery's replay draws the
masks of the first attempt, so losses and weights equal the seeded one-process reference (and
so a run without the fault), also when the replay runs on a different partition."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.reference import DROPOUT_GPT, Reference

OPTIMIZER = {"name": "adam", "lr": 1e-2}
NUM_MICROBATCHES = 4
TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize(
    ("fault", "num_processes", "checkpoint_every"),
    [
        ("forward:3:1", 3, 2),  # a spare takes rank 1's layers; restore step 2, replay nothing
        ("backward:4:0", 2, 0),  # no spare: the survivor takes every layer, replays steps 1-3
    ],
)
def test_replay_after_a_killed_stage_equals_the_run_without_the_fault(
    tmp_path: Path, fault: str, num_processes: int, checkpoint_every: int
) -> None:
    marker = str(tmp_path / "fault-fired")
    problem = DROPOUT_GPT
    reference = Reference(problem, seed=21, optimizer=OPTIMIZER, clip_grad_norm=None)
    with (
        pipesvc.LocalCluster(
            num_stages=num_processes,
            threads_per_stage=1,
            stage_args=["--fault-kill", f"{fault}:{marker}"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model=problem.model,
            model_args=problem.model_args,
            seed=21,
            num_stages=2,
            num_microbatches=NUM_MICROBATCHES,
            optimizer=OPTIMIZER,
            loss=problem.loss,
            checkpoint_every=checkpoint_every,
        ) as job,
    ):
        for step in range(5):
            x, y = problem.batch(8, seed=step)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y, NUM_MICROBATCHES), rel=1e-5)
        assert os.path.exists(marker), "the fault never fired"
        assert job.refresh().recoveries == 1
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")
