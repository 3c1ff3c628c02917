"""Models with parameter-free layers, trained next to the one-process oracle.

``cnn`` has a Flatten layer; ``relu-mlp`` (tests/support/models/relu_models.py, loaded by
stages with ``--models``) alternates Linear and ReLU layers. Both must checkpoint, resume,
recover and replay like any model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import pipesvc
import tests.support.models.relu_models  # noqa: F401 - registers relu-mlp here too
from tests.support.reference import PROBLEMS, Problem, Reference

MODELS_MODULE = "tests.support.models.relu_models"
PARAM_FREE = {
    "cnn": PROBLEMS["cnn"],
    "relu-mlp": Problem("relu-mlp", {"width": 6, "depth": 3}, "mse", (6,), target_shape=(3,)),
}
TOL = {"rtol": 1e-5, "atol": 1e-6}
OPTIMIZER = {"name": "adam", "lr": 1e-2}
CHECKPOINT_EVERY = 2


@dataclass
class Training:
    """A job trained step by step next to the whole model in one process."""

    job: pipesvc.Job
    reference: Reference
    problem: Problem
    step_seconds: list[float] = field(default_factory=list)

    @classmethod
    def start(
        cls, client: pipesvc.Client, model: str, *, num_stages: int = 2, **extra: Any
    ) -> Training:
        problem = PARAM_FREE[model]
        job = client.create_job(
            model=model,
            model_args=problem.model_args,
            seed=7,
            num_stages=num_stages,
            num_microbatches=2,
            loss=problem.loss,
            optimizer=OPTIMIZER,
            checkpoint_every=CHECKPOINT_EVERY,
            **extra,
        )
        return cls(
            job, Reference(problem, seed=7, optimizer=OPTIMIZER, clip_grad_norm=None), problem
        )

    def step(self) -> float:
        """One step on both; the pipeline's loss must be the oracle's."""
        number = self.job.step
        x, y = self.problem.batch(4 + number % 3, seed=number)
        loss = self.job.train_step(x, y)
        assert loss == pytest.approx(self.reference.step(x, y), rel=1e-5, abs=1e-6)
        return loss

    def check_weights(self) -> None:
        weights = self.job.state_dict()
        expected = self.reference.model.state_dict()
        assert weights.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")
