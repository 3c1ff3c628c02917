"""The contract: a pipelined job trains exactly like the whole model in one process."""

from __future__ import annotations

import itertools

import pytest
import torch

import pipesvc
from tests.integration.reference import PROBLEMS, Reference

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
WEIGHT_TOL = {"rtol": 1e-4, "atol": 1e-5}
OPTIMIZER_CYCLE = [
    {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
    {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    {"name": "adam", "lr": 1e-2, "betas": [0.8, 0.95]},
]
CASES = [
    (model, schedule, num_stages)
    for model, schedule, num_stages in itertools.product(
        sorted(PROBLEMS), ("gpipe", "1f1b"), (2, 3, 4)
    )
]
# Even, uneven (7 = 2+2+2+1) and uneven-the-other-way (9) batches over 4 micro-batches.
BATCH_SIZES = (8, 7, 9)
NUM_MICROBATCHES = 4


@pytest.mark.parametrize(("model", "schedule", "num_stages"), CASES)
def test_training_matches_one_process(
    client: pipesvc.Client, model: str, schedule: str, num_stages: int
) -> None:
    index = CASES.index((model, schedule, num_stages))
    problem = PROBLEMS[model]
    optimizer = OPTIMIZER_CYCLE[index % len(OPTIMIZER_CYCLE)]
    clip = 0.5 if index % 2 else None
    partition = "parameters" if index % 4 < 2 else "uniform"
    seed = 100 + index
    reference = Reference(problem, seed=seed, optimizer=optimizer, clip_grad_norm=clip)
    with client.create_job(
        model=model,
        model_args=problem.model_args,
        seed=seed,
        num_stages=num_stages,
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        optimizer=optimizer,
        loss=problem.loss,
        partition=partition,
        clip_grad_norm=clip,
    ) as job:
        assert len(job.plan) == num_stages
        initial = job.state_dict()
        expected_initial = reference.model.state_dict()
        assert initial.keys() == expected_initial.keys()
        for key, value in expected_initial.items():
            torch.testing.assert_close(initial[key], value, rtol=0, atol=0)

        for step, batch_size in enumerate(BATCH_SIZES):
            x, y = problem.batch(batch_size, seed=step)
            expected_grads = reference.accumulated_gradients(x, y, NUM_MICROBATCHES)
            loss = job.train_step(x, y)
            expected_loss = reference.step(x, y)
            assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
            grads = job.gradients()
            assert grads.keys() == expected_grads.keys()
            for key, value in expected_grads.items():
                torch.testing.assert_close(
                    grads[key], value, **GRAD_TOL, msg=lambda m, k=key: f"{k}: {m}"
                )
            weights = job.state_dict()
            for key, value in reference.model.state_dict().items():
                torch.testing.assert_close(
                    weights[key], value, **WEIGHT_TOL, msg=lambda m, k=key: f"{k}: {m}"
                )
        assert job.step == len(BATCH_SIZES)

        x, _ = problem.batch(5, seed=99)
        with torch.no_grad():
            expected_out = reference.model(x)
        torch.testing.assert_close(job.forward(x), expected_out, **WEIGHT_TOL)
