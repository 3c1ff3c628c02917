"""A stage that does not answer for a moment between steps is not taken for lost: the check
before a call waits for ``--health-failures`` misses in a row, as the watchdog does during one.

The stage is stopped (SIGSTOP) between two steps for longer than one health check's deadline
but shorter than the misses the coordinator allows, then goes on. The next step, called while
the stage is still stopped, must run on the same plan with no recovery and the one-process loss.
With one miss enough, as before, the coordinator rebuilt the job without the stage.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pipesvc
from tests.support.faults import Run, stage_pid
from tests.support.metrics import coordinator_metric

IDLE_S = 1.3
"""How long the stage is stopped before the next step is called: more than
``--health-interval-s``, so that the step checks the stages first."""
STOPPED_S = 3.0
"""How long the stage stays stopped: several checks' deadlines (1 s each), and well within the
six checks, a second apart, that the coordinator allows."""


def test_a_stage_stopped_for_a_moment_between_steps_is_not_replaced() -> None:
    with (
        pipesvc.LocalCluster(
            num_stages=2,
            threads_per_stage=1,
            coordinator_args=["--metrics-port", "0", "--health-failures", "6"],
        ) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=0)
        run.step()
        plan = [(s.address, s.start_layer, s.end_layer) for s in run.job.plan]
        pid = stage_pid(run.job.plan[1].address)
        resume = threading.Timer(STOPPED_S, os.kill, (pid, signal.SIGCONT))
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        resume.start()
        try:
            time.sleep(IDLE_S)
            run.step()  # called while the stage is stopped
            waited = time.monotonic() - stopped
            run.step()
        finally:
            resume.cancel()
            os.kill(pid, signal.SIGCONT)
        assert coordinator_metric(cluster, "recoveries_total") == 0
        assert [(s.address, s.start_layer, s.end_layer) for s in run.job.refresh().plan] == plan
        assert waited >= STOPPED_S  # the step ran on the stopped stage, once it went on
        run.check_weights()
