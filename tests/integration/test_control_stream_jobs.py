"""A job on the shared cluster drives its stages over one Control stream each (see [Note:
control stream] in pipesvc/coordinator/control_stream.py): every step, its commits, an
inference run and the flush before a state read, and the streams close with the job."""

from __future__ import annotations

import time

import pytest
import torch

import pipesvc
from tests.support.reference import PROBLEMS, Reference
from tests.support.stage_probe import stage_info

MLP = PROBLEMS["mlp"]
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def test_a_job_keeps_one_stream_per_stage_for_all_its_steps(client: pipesvc.Client) -> None:
    job = client.create_job(
        model="mlp",
        model_args=MLP.model_args,
        seed=5,
        num_stages=2,
        num_microbatches=2,
        loss="mse",
        optimizer=OPTIMIZER,
    )
    addresses = [s.address for s in job.plan]
    before = {a: stage_info(a).control_streams_opened for a in addresses}
    reference = Reference(MLP, seed=5, optimizer=OPTIMIZER, clip_grad_norm=None)
    batches = [MLP.batch(6 + i % 3, seed=i) for i in range(12)]
    for x, y in batches[:6]:
        assert job.train_step(x, y) == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
    expected = [reference.step(x, y) for x, y in batches[6:]]
    assert list(job.train(batches[6:])) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    job.forward(MLP.batch(4, seed=50)[0])
    weights = job.state_dict()  # flushes the last step's commit first
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)
    infos = {a: stage_info(a) for a in addresses}
    assert {a: i.control_streams_opened - before[a] for a, i in infos.items()} == {
        a: 1 for a in addresses
    }
    assert all(i.control_streams_open >= 1 and i.step == 12 for i in infos.values())
    job.close()
    deadline = time.monotonic() + 10
    while any(stage_info(a).control_streams_open for a in addresses):
        assert time.monotonic() < deadline, "the job's streams stayed open after it closed"
        time.sleep(0.05)
