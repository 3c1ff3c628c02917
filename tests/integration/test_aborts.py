"""An aborted run changes nothing it should not: a failed inference keeps the gradients of the
last committed training step on every stage."""

from __future__ import annotations

import pytest
import torch

import pipesvc
from tests.support.reference import PROBLEMS

MLP = PROBLEMS["mlp"]


def test_failed_forward_keeps_the_last_steps_gradients(client: pipesvc.Client) -> None:
    with client.create_job(
        model="mlp",
        model_args=MLP.model_args,
        seed=3,
        num_stages=3,
        num_microbatches=2,
        loss=MLP.loss,
        optimizer={"name": "sgd", "lr": 0.1},
    ) as job:
        x, y = MLP.batch(6, seed=0)
        job.train_step(x, y)
        before = job.gradients()
        assert before.keys() == job.state_dict().keys()
        weights = job.state_dict()
        # Fails on rank 0's first layer; ranks 1 and 2 are aborted while they wait for it.
        with pytest.raises(pipesvc.InvalidArgumentError, match="layer 0 failed"):
            job.forward(torch.randn(4, MLP.input_shape[0] + 1))
        after = job.gradients()
        assert after.keys() == before.keys()
        for key, value in before.items():
            torch.testing.assert_close(after[key], value, rtol=0, atol=0)
        for key, value in weights.items():
            torch.testing.assert_close(job.state_dict()[key], value, rtol=0, atol=0)
        assert job.refresh().recoveries == 0
