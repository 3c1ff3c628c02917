"""create_job's bounded wait for stages that are still starting."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import pipesvc
from pipesvc.errors import PlanError
from tests.support.reference import PROBLEMS

MLP = PROBLEMS["mlp"]


def test_create_job_waits_for_a_stage_that_is_still_starting() -> None:
    with (
        pipesvc.LocalCluster(num_stages=1, threads_per_stage=1) as cluster,
        cluster.connect(timeout_s=120) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        spec = {"model": "mlp", "model_args": MLP.model_args, "num_stages": 2, "loss": "mse"}
        with pytest.raises(PlanError, match=r"num_stages \(2\) exceeds .* \(1 of 1 registered\)"):
            client.create_job(**spec)  # without the wait: as before
        creating = pool.submit(client.create_job, **spec, wait_for_stages_s=90)
        time.sleep(1.0)  # the call is in flight, waiting: then the second stage starts
        assert not creating.done(), "create_job returned before the second stage was started"
        added = threading.Event()
        threading.Thread(target=lambda: (cluster.add_stage(), added.set()), daemon=True).start()
        with creating.result(timeout=110) as job:
            assert len(job.plan) == 2
            x, y = MLP.batch(8, seed=0)
            assert job.train_step(x, y) > 0
        assert added.wait(60)
