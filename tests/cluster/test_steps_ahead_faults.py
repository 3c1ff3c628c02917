"""Runs sent ahead (see [Note: steps ahead] in pipesvc/coordinator/step_runner.py) when the
run they follow fails after some stage has already applied it.

With one micro-batch on two stages, the last stage's part of a step ends when it sends its
gradient back; the run sent ahead then applies the step there at once, while the first stage
is still in its backward. A fault in that backward fails the step after the last stage moved
past it: the job must not keep a step the client was told failed, and one it recovers from must
give the one-process losses. Both checks fail if the coordinator does not find the stage that
went ahead and rebuild it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.faults import MLP, Run
from tests.support.metrics import coordinator_metric

NUM_STEPS = 10
FAULT_STEP = 5


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [MLP.batch(8 + i % 3, seed=i) for i in range(NUM_STEPS)]


def _cluster(tmp_path: Path, action: str, num_stages: int) -> pipesvc.LocalCluster:
    marker = str(tmp_path / "fault-fired")
    return pipesvc.LocalCluster(
        num_stages=num_stages,
        threads_per_stage=1,
        coordinator_args=["--metrics-port", "0"],
        stage_args=["--fault-kill", f"backward-{action}:{FAULT_STEP}:0:{marker}"],
    )


def test_a_step_that_fails_after_a_stage_applied_it_is_undone(tmp_path: Path) -> None:
    """Four steps, then a read of the weights (which commits the fourth), then a second
    stream whose first step, step 5, carries no commit. The first stage's backward of step 5
    fails with RESOURCE_EXHAUSTED (a final error): the stream ends with it, the job is at
    step 4 with the one-process weights of step 4 although the last stage had applied step 5
    on its way to step 6, and training on gives the one-process losses."""
    with _cluster(tmp_path, "fail", 2) as cluster, cluster.connect() as client:
        run = Run.start(client, checkpoint_every=3, num_microbatches=1)
        batches = _batches()
        first = batches[: FAULT_STEP - 1]
        assert list(run.job.train(first)) == pytest.approx(
            [run.reference.step(x, y) for x, y in first], rel=1e-5, abs=1e-6
        )
        run.check_weights()  # also commits step 4: step 5's run carries nothing
        with pytest.raises(pipesvc.ResourceExhaustedError):
            list(run.job.train(batches[FAULT_STEP - 1 :]))
        assert os.path.exists(tmp_path / "fault-fired"), "the fault never fired"
        assert run.job.step == FAULT_STEP - 1
        run.check_weights()
        rest = batches[FAULT_STEP - 1 :]
        assert list(run.job.train(rest)) == pytest.approx(
            [run.reference.step(x, y) for x, y in rest], rel=1e-5, abs=1e-6
        )
        assert run.job.step == NUM_STEPS
        run.check_weights()
        sent_ahead = coordinator_metric(cluster, "runs_sent_ahead_total")
        assert sent_ahead >= NUM_STEPS / 2, "the runs did not go ahead"


def test_a_stage_killed_after_another_applied_its_step_costs_no_step(tmp_path: Path) -> None:
    """The first stage dies in its backward of step 5, after the last stage applied step 5 on
    its way to step 6: a spare takes its place, every stage is rebuilt to step 4, and the
    stream goes on with the one-process losses."""
    with _cluster(tmp_path, "kill", 3) as cluster, cluster.connect() as client:
        run = Run.start(client, checkpoint_every=3, num_microbatches=1)
        batches = _batches()
        losses = list(run.job.train(batches))
        assert os.path.exists(tmp_path / "fault-fired"), "the fault never fired"
        assert losses == pytest.approx(
            [run.reference.step(x, y) for x, y in batches], rel=1e-5, abs=1e-6
        )
        assert run.job.step == NUM_STEPS
        assert run.job.recoveries == 1
        run.check_weights()
        assert coordinator_metric(cluster, "runs_sent_ahead_total") >= NUM_STEPS / 2, (
            "the runs did not go ahead"
        )
