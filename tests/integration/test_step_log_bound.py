"""``checkpoint_every=0`` takes no periodic checkpoint, but its step log is bounded: once the
log holds more than a checkpoint's size (at least 64 MiB, ``LOG_BOUND_MIN_BYTES``), a
checkpoint is taken anyway and the log behind it pruned (see [Note: checkpoint cadence])."""

from __future__ import annotations

import time

import pytest

import pipesvc
from pipesvc.coordinator.step_log import StepLog
from pipesvc.core.cadence import LOG_BOUND_MIN_BYTES
from tests.support.reference import Problem, Reference

WIDE = {"in_features": 4096, "hidden_features": 8, "out_features": 3, "num_layers": 2}
OPTIMIZER = {"name": "sgd", "lr": 0.01}


def test_the_step_log_of_a_job_without_checkpoints_stays_bounded(
    cluster: pipesvc.LocalCluster, client: pipesvc.Client
) -> None:
    problem = Problem("mlp", WIDE, "mse", (4096,), target_shape=(3,))
    reference = Reference(problem, seed=5, optimizer=OPTIMIZER, clip_grad_norm=None)
    with client.create_job(
        model="mlp",
        model_args=WIDE,
        seed=5,
        num_stages=2,
        num_microbatches=2,
        loss="mse",
        optimizer=OPTIMIZER,
        checkpoint_every=0,
    ) as job:
        steps = cluster.log_dir / "state" / "jobs" / job.id / "steps"
        per_step = 0
        for step in range(1, 7):  # 16 MiB of inputs a step: past 64 MiB at step 4
            x, y = problem.batch(1024, seed=step)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
            per_step = per_step or sum(p.stat().st_size for p in steps.iterdir())
        deadline = time.monotonic() + 60
        while job.refresh().checkpoint_step == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # the checkpoint is written while later steps train
        assert job.checkpoint_step == LOG_BOUND_MIN_BYTES // per_step + 1
        held = sum(p.stat().st_size for p in steps.iterdir())
        assert held <= LOG_BOUND_MIN_BYTES
        assert sorted(StepLog(steps).entries()) == list(range(job.checkpoint_step + 1, 7))
