"""A job handle follows recoveries by itself: the reply that recovered carries the new plan."""

from __future__ import annotations

import os
from pathlib import Path

import pipesvc
from tests.support.faults import Run


def test_plan_and_recoveries_follow_a_recovery_without_refresh(tmp_path: Path) -> None:
    marker = str(tmp_path / "fault-fired")
    with (
        pipesvc.LocalCluster(
            num_stages=3, threads_per_stage=1, stage_args=["--fault-kill", f"forward:2:1:{marker}"]
        ) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client)
        before = list(run.job.plan)
        run.step()
        assert (run.job.plan, run.job.recoveries) == (before, 0)
        run.step()  # rank 1 dies in its forward of step 2; a spare takes over its layers
        assert os.path.exists(marker), "the fault never fired"
        # No refresh(): the train_step reply carried the job as it is after the recovery.
        assert run.job.recoveries == 1
        assert run.job.plan[1].address != before[1].address
        assert run.job.plan[0] == before[0]
        fresh = client.get_job(run.job.id)
        assert (run.job.plan, run.job.plan_epoch) == (fresh.plan, fresh.plan_epoch)
        assert "recoveries=1" in repr(run.job)
        assert run.job.plan[1].address in repr(run.job)
        run.step()
        run.check_weights()
