"""``job.train`` through faults: a stage killed and a coordinator killed in the middle of a
stream still give every step exactly once, with the one-process oracle's losses and weights
(see [Note: stream reconnect] in pipesvc/step_stream.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.faults import MLP, Run

NUM_STEPS = 12


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [MLP.batch(8 + i % 3, seed=i) for i in range(NUM_STEPS)]


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_a_stage_killed_mid_stream_costs_no_step(tmp_path: Path, when: str) -> None:
    """Rank 1 dies in step 5 while later steps wait on the coordinator: a spare takes its
    place, the logged steps are replayed, and the stream goes on with exact losses."""
    marker = str(tmp_path / "fault-fired")
    with (
        pipesvc.LocalCluster(
            num_stages=3, threads_per_stage=1, stage_args=["--fault-kill", f"{when}:5:1:{marker}"]
        ) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=3)
        batches = _batches()
        losses = list(run.job.train(batches))
        assert os.path.exists(marker), "the fault never fired"
        assert losses == pytest.approx(
            [run.reference.step(x, y) for x, y in batches], rel=1e-5, abs=1e-6
        )
        assert run.job.step == NUM_STEPS
        assert run.job.recoveries == 1
        run.check_weights()


def test_a_coordinator_killed_mid_stream_applies_each_step_once() -> None:
    """The coordinator is killed after the fifth loss, with the next steps sent and maybe
    running or decided: the client reconnects to the restarted one, sends its unreplied steps
    again under their request ids, and every step is applied exactly once, in order."""
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        client = cluster.connect()
        run = Run.start(client, checkpoint_every=4)
        batches = _batches()
        losses = []
        for number, loss in enumerate(run.job.train(batches), start=1):
            losses.append(loss)
            if number == 5:
                cluster.restart_coordinator(kill=True)
        assert losses == pytest.approx(
            [run.reference.step(x, y) for x, y in batches], rel=1e-5, abs=1e-6
        )
        assert run.job.step == NUM_STEPS
        client.close()
        with cluster.connect() as client:
            run.job = client.get_job(run.job.id)
            assert run.job.step == NUM_STEPS
            run.step()
            run.check_weights()
