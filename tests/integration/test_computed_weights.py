"""Linear layers whose weights are computed from parameters (weight_norm) train the same under
zb-h1, whose split backward defers weight gradients, as under 1F1B and in one process."""

from __future__ import annotations

import pytest
import torch

import pipesvc
import tests.support.models.weight_norm_models  # noqa: F401  (registers it here too)
from tests.support.reference import Problem, Reference

MODULE = "tests.support.models.weight_norm_models"
PROBLEM = Problem("weight-normed-mlp", {"width": 8, "depth": 3}, "mse", (6,), target_shape=(3,))
OPTIMIZER = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
NUM_MICROBATCHES = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_weight_norm_trains_alike_under_zb_h1_1f1b_and_one_process() -> None:
    with (
        pipesvc.LocalCluster(num_stages=2, threads_per_stage=1, models=[MODULE]) as cluster,
        cluster.connect() as client,
    ):
        results = {}
        for schedule in ("1f1b", "zb-h1"):
            reference = Reference(PROBLEM, seed=3, optimizer=OPTIMIZER, clip_grad_norm=None)
            with client.create_job(
                model=PROBLEM.model,
                model_args=PROBLEM.model_args,
                seed=3,
                num_stages=2,
                num_microbatches=NUM_MICROBATCHES,
                schedule=schedule,
                loss=PROBLEM.loss,
                optimizer=OPTIMIZER,
                partition="uniform",
            ) as job:
                for step in range(2):
                    x, y = PROBLEM.batch(8, seed=step)
                    expected = reference.accumulated_gradients(x, y, NUM_MICROBATCHES)
                    loss = job.train_step(x, y)
                    assert loss == pytest.approx(reference.step(x, y, NUM_MICROBATCHES), rel=1e-5)
                    grads = job.gradients()
                    assert sorted(grads) == sorted(expected), schedule
                    assert any("original0" in key for key in grads)  # weight_norm's magnitude
                    for key, value in expected.items():
                        torch.testing.assert_close(grads[key], value, **TOL, msg=key)
                results[schedule] = (grads, job.state_dict())
        (grads_1f1b, weights_1f1b), (grads_zb, weights_zb) = results["1f1b"], results["zb-h1"]
        for key, value in grads_1f1b.items():
            torch.testing.assert_close(grads_zb[key], value, **TOL, msg=key)
        for key, value in weights_1f1b.items():
            torch.testing.assert_close(weights_zb[key], value, **TOL, msg=key)
