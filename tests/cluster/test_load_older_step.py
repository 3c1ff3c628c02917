"""Loading a state at a step older than the job's newest checkpoint starts a new lineage: its
checkpoint is the one recovery restores, the newer checkpoints and logged steps are gone, and
a recovery after it restores the loaded state and replays only the new lineage's steps."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import pipesvc
from pipesvc.coordinator.step_log import StepLog
from pipesvc.storage.checkpoint import read_manifest
from tests.support.faults import Run, stage_pid


def test_loading_an_older_step_supersedes_newer_checkpoints_and_logged_steps(
    tmp_path: Path,
) -> None:
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=2)
        for _ in range(2):
            run.step()
        run.job.save(tmp_path / "step2")
        at_two = copy.deepcopy(run.reference)
        for _ in range(5):
            run.step()  # checkpoints at steps 4 and 6; step 7 logged
        run.job._load_checkpoint(tmp_path / "step2", read_manifest(tmp_path / "step2"))
        job = run.job.refresh()
        assert (job.step, job.checkpoint_step) == (2, 2)
        root = cluster.log_dir / "state" / "jobs" / job.id
        checkpoints = sorted(p.name for p in (root / "checkpoints").iterdir())
        assert checkpoints == ["step-000000002"]
        logged = sorted(StepLog(root / "steps").entries())
        assert all(step <= 2 for step in logged), logged
        run.reference = at_two
        run.step()  # step 3 of the new lineage
        os.kill(stage_pid(job.plan[1].address), signal.SIGKILL)
        run.step()  # step 4: restore the step-2 checkpoint, replay step 3, run step 4
        assert run.job.refresh().recoveries == 1
        assert run.job.step == 4
        run.check_weights()
