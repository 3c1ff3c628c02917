"""Dropout and batch statistics on a real cluster: a gpt with dropout trains exactly like the
seeded one-process reference, ``forward`` runs in eval mode, and BatchNorm is refused at job
creation when the batch is split into micro-batches."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pipesvc
from pipesvc import models
from tests.support.reference import DROPOUT_GPT, Problem, Reference

NORM_MODULE = "tests.support.models.norm_models"
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
WEIGHT_TOL = {"rtol": 1e-4, "atol": 1e-5}
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
NUM_MICROBATCHES = 4
BATCH_SIZES = (8, 7, 9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_dropout_training_matches_the_seeded_reference(
    client: pipesvc.Client, num_stages: int, schedule: str
) -> None:
    seed = 40 + num_stages
    problem = DROPOUT_GPT
    reference = Reference(problem, seed=seed, optimizer=OPTIMIZER, clip_grad_norm=None)
    with client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=seed,
        num_stages=num_stages,
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        optimizer=OPTIMIZER,
        loss=problem.loss,
        partition="uniform",
    ) as job:
        for step, batch_size in enumerate(BATCH_SIZES):
            x, y = problem.batch(batch_size, seed=step)
            expected_grads = reference.accumulated_gradients(x, y, NUM_MICROBATCHES)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y, NUM_MICROBATCHES), rel=1e-5)
            grads = job.gradients()
            assert grads.keys() == expected_grads.keys()
            for key, value in expected_grads.items():
                torch.testing.assert_close(
                    grads[key], value, **GRAD_TOL, msg=lambda m, k=key: f"{k}: {m}"
                )
            _check_weights(job, reference)
        x, _ = problem.batch(3, seed=99)
        first, second = job.forward(x), job.forward(x)
        assert torch.equal(first, second)
        with torch.no_grad():
            expected = reference.model.eval()(x)
        torch.testing.assert_close(first, expected, **WEIGHT_TOL)


def _check_weights(job: pipesvc.Job, reference: Reference) -> None:
    weights = job.state_dict()
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(
            weights[key], value, **WEIGHT_TOL, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.fixture(scope="module")
def norm_client() -> Iterator[pipesvc.Client]:
    # The stages import NORM_MODULE from this checkout (tests/conftest.py puts it on their path).
    with (
        pipesvc.LocalCluster(num_stages=2, models=[NORM_MODULE], threads_per_stage=1) as cluster,
        pipesvc.connect(cluster.address, timeout_s=120) as connected,
    ):
        yield connected


def test_batchnorm_is_refused_with_several_microbatches(norm_client: pipesvc.Client) -> None:
    with (
        pytest.raises(pipesvc.InvalidArgumentError) as raised,
        norm_client.create_job(
            model="tiny-batchnorm", num_stages=2, num_microbatches=2, loss="mse"
        ),
    ):
        pass
    message = str(raised.value)
    assert "layer 1" in message and "BatchNorm1d" in message, message
    assert "num_microbatches (2)" in message, message
    assert not any(s.job_id for s in norm_client.stages())  # nothing is left assigned


def test_batchnorm_with_one_microbatch_trains_like_one_process(
    norm_client: pipesvc.Client,
) -> None:
    models.import_model_modules([NORM_MODULE])
    problem = Problem("tiny-batchnorm", {"width": 4}, "mse", (4,), target_shape=(4,))
    optimizer = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    reference = Reference(problem, seed=3, optimizer=optimizer, clip_grad_norm=None)
    with norm_client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=3,
        num_stages=2,
        num_microbatches=1,
        loss="mse",
        optimizer=optimizer,
    ) as job:
        for step in range(3):
            x, y = problem.batch(6, seed=step)
            assert job.train_step(x, y) == pytest.approx(reference.step(x, y), rel=1e-5)
            _check_weights(job, reference)  # running statistics included
        x, _ = problem.batch(5, seed=99)
        with torch.no_grad():
            expected = reference.model.eval()(x)
        torch.testing.assert_close(job.forward(x), expected, **WEIGHT_TOL)
