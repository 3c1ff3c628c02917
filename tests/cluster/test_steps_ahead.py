"""A stream's next step goes ahead of the running one's decision even when it arrives while the
running one's run is out (see [Note: steps ahead] in pipesvc/coordinator/step_runner.py), as
the first step of a stream does, or the steps of a client that loads each batch as it goes.

The last stage is stopped (SIGSTOP) while each stream's first step runs, so that step cannot
be decided before the second arrives, 0.1 s after the first and long after the first step's log
entry is written; the stage goes on once the second went ahead (or after 3 s). Asked for
only at that write, as before this test, the second step never went ahead (0 of 4); now each
does, and the losses and weights are the one-process ones.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch

import pipesvc
from tests.support.faults import MLP, Run, stage_pid
from tests.support.metrics import coordinator_metric

STREAMS = 4
LATE_S = 0.1
"""How long after the stream's first batch its second comes."""
HELD_S = 3.0
"""How long at most the stage stays stopped waiting for the second step to go ahead (the
coordinator here declares a stage lost after 20 missed health checks, about 20 s, not 2)."""

Batch = tuple[torch.Tensor, torch.Tensor]


def _held(
    batches: list[Batch], stopped: int, sent_ahead: Callable[[], float], until: float
) -> Iterator[Batch]:
    """The two batches of a stream, the second late, with the stage ``stopped`` stopped from
    before the first until the second went ahead (``sent_ahead`` reaching ``until``)."""
    first, second = batches
    os.kill(stopped, signal.SIGSTOP)
    ends = time.monotonic() + HELD_S
    try:
        yield first
        time.sleep(LATE_S)  # the first step's run is out, held by the stopped stage
        yield second
        while sent_ahead() < until and time.monotonic() < ends:
            time.sleep(0.01)
    finally:
        os.kill(stopped, signal.SIGCONT)


def test_a_step_that_arrives_while_the_run_before_is_out_goes_ahead() -> None:
    with (
        pipesvc.LocalCluster(
            num_stages=2,
            threads_per_stage=1,
            coordinator_args=["--metrics-port", "0", "--health-failures", "20"],
        ) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=0, num_microbatches=2)
        run.step()  # opens the job's streams to the stages
        last = stage_pid(run.job.plan[1].address)

        def sent_ahead() -> float:
            return coordinator_metric(cluster, "runs_sent_ahead_total")

        try:
            for stream in range(STREAMS):
                batches = [MLP.batch(8, seed=2 * stream + i) for i in range(2)]
                losses = list(run.job.train(_held(batches, last, sent_ahead, stream + 1)))
                assert losses == pytest.approx(
                    [run.reference.step(x, y) for x, y in batches], rel=1e-5, abs=1e-6
                )
        finally:
            os.kill(last, signal.SIGCONT)
        run.check_weights()
        # Were a held stage still taken for lost on a loaded machine, the job would recover,
        # exactly (checked above), and the runs went ahead anyway.
        assert sent_ahead() >= STREAMS
