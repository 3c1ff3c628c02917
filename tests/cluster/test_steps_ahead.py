"""A stream's next step goes ahead of the running one's decision even when it arrives while the
running one's run is out (see [Note: steps ahead] in pipesvc/coordinator/step_runner.py), as
the first step of a stream does, or the steps of a client that loads each batch as it goes.

The last stage is stopped (SIGSTOP) while each stream's first step runs, so that step cannot
be decided before the second arrives, 0.2 s after the first and long after the first step's log
entry is written. Asked for only then, as before this test, the second step never went ahead
(0 of 4); now each does, and the losses and weights are the one-process ones.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

import pipesvc
from tests.support.faults import MLP, Run, stage_pid
from tests.support.metrics import coordinator_metric

STREAMS = 4
LATE_S = 0.2
"""How long after the stream's first batch its second comes, and then how long the stopped
stage stays stopped with both steps at the coordinator."""

Batch = tuple[torch.Tensor, torch.Tensor]


def _held(batches: list[Batch], stopped: int) -> Iterator[Batch]:
    """The two batches of a stream, the second late, with the stage ``stopped`` stopped from
    before the first until after the second was sent."""
    first, second = batches
    os.kill(stopped, signal.SIGSTOP)
    try:
        yield first
        time.sleep(LATE_S)  # the first step's run is out, held by the stopped stage
        yield second
        time.sleep(LATE_S)  # the second step arrives while the first cannot end
    finally:
        os.kill(stopped, signal.SIGCONT)


def test_a_step_that_arrives_while_the_run_before_is_out_goes_ahead() -> None:
    with (
        pipesvc.LocalCluster(
            num_stages=2, threads_per_stage=1, coordinator_args=["--metrics-port", "0"]
        ) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=0, num_microbatches=2)
        last = stage_pid(run.job.plan[1].address)
        for stream in range(STREAMS):
            batches = [MLP.batch(8, seed=2 * stream + i) for i in range(2)]
            losses = list(run.job.train(_held(batches, last)))
            assert losses == pytest.approx(
                [run.reference.step(x, y) for x, y in batches], rel=1e-5, abs=1e-6
            )
        run.check_weights()
        assert run.job.recoveries == 0
        assert coordinator_metric(cluster, "runs_sent_ahead_total") == STREAMS
