"""Memory exhausted on a stage is the stage's failure, not the caller's: a typed refusal that
changes nothing, while an input the model cannot take is still the caller's error."""

from __future__ import annotations

import pytest
import torch

import pipesvc

MODULE = "tests.support.models.memory_models"


def test_a_stage_out_of_memory_is_refused_as_such_and_the_job_goes_on() -> None:
    with (
        pipesvc.LocalCluster(num_stages=2, threads_per_stage=1, models=[MODULE]) as cluster,
        cluster.connect() as client,
    ):
        for where, how in (("forward", "raise"), ("backward", "raise"), ("forward", "allocate")):
            with client.create_job(
                model="hungry-mlp",
                model_args={"where": where, "how": how},
                num_stages=2,
                num_microbatches=2,
                loss="mse",
                optimizer={"name": "sgd", "lr": 0.1},
            ) as job:
                small = torch.randn(8, 4), torch.randn(8, 4)  # 4 rows per micro-batch fit
                job.train_step(*small)
                weights = job.state_dict()
                with pytest.raises(pipesvc.StageOutOfMemoryError) as raised:
                    job.train_step(torch.randn(16, 4), torch.randn(16, 4))
                message = str(raised.value)
                assert "ran out of cpu memory" in message, message
                assert f"the {where}" in message, message
                assert isinstance(raised.value, pipesvc.ResourceExhaustedError)
                job.refresh()
                assert (job.step, job.recoveries) == (1, 0)  # nothing ran again or changed
                for key, value in job.state_dict().items():
                    torch.testing.assert_close(value, weights[key], rtol=0, atol=0)
                # An input the layers cannot take is still the caller's error.
                with pytest.raises(pipesvc.InvalidArgumentError, match="layer 0 failed") as bad:
                    job.train_step(torch.randn(8, 5), torch.randn(8, 4))
                assert not isinstance(bad.value, pipesvc.ResourceExhaustedError)
                job.train_step(*small)
                assert job.step == 2
