"""Faults at commit and past periodic checkpoints, on models with parameter-free layers.

A commit is all-or-none as seen by every later call: a stage stopped at commit is detected by
the health watchdog and the step completes through recovery; a Commit refused on one stage after
others applied theirs is completed. Every test ends with every stage at the same step and
weights equal to the one-process oracle.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import pipesvc
from tests.support.faults import stage_pid
from tests.support.param_free import MODELS_MODULE, PARAM_FREE, Training
from tests.support.stage_probe import stage_info

NUM_STEPS = 7  # periodic checkpoints at steps 2, 4 and 6


def _cluster(fault: str, *coordinator_args: str) -> pipesvc.LocalCluster:
    """Three stages: a two-stage job and a spare."""
    return pipesvc.LocalCluster(
        num_stages=3,
        threads_per_stage=1,
        models=[MODELS_MODULE],
        stage_args=["--fault-kill", fault],
        coordinator_args=list(coordinator_args),
    )


def _steps_of(job: pipesvc.Job) -> set[int]:
    return {stage_info(s.address).step for s in job.refresh().plan}


@pytest.mark.parametrize("model", sorted(PARAM_FREE))
def test_killed_stage_past_two_checkpoints_restores_and_replays(tmp_path: Path, model: str) -> None:
    """Killed in step 6: restore the step-4 checkpoint, replay step 5, run step 6 again."""
    marker = tmp_path / "fired"
    with _cluster(f"forward:6:1:{marker}") as cluster, cluster.connect() as client:
        training = Training.start(client, model)
        for _ in range(NUM_STEPS):
            training.step()
        assert marker.exists(), "the fault never fired"
        assert training.job.refresh().recoveries == 1
        assert _steps_of(training.job) == {NUM_STEPS}
        training.check_weights()


@pytest.mark.timeout(240)
def test_stage_stopped_at_commit_is_detected_and_the_step_completes(tmp_path: Path) -> None:
    """SIGSTOP on rank 1 as step 5's commit arrives, carried by step 6's run (rank 0 commits
    and starts the run). The watchdog finds it in a few health intervals (the control deadline
    here is 600 s, past this test's timeout); a spare replaces it, the step-4 checkpoint is
    restored, step 5 replayed from the log and step 6 run again."""
    marker = tmp_path / "fired"
    with _cluster(f"commit-stop:5:1:{marker}", "--control-timeout-s", "600") as cluster:
        with cluster.connect() as client:
            training = Training.start(client, "relu-mlp")
            stopped = training.job.plan[1].address
            pid = stage_pid(stopped)
            try:
                for _ in range(5):
                    training.step()
                started = time.monotonic()
                training.step()
                took = time.monotonic() - started
                assert marker.exists(), "the fault never fired"
                assert _steps_of(training.job) == {6}
                for _ in range(NUM_STEPS - 6):
                    training.step()
            finally:
                os.kill(pid, signal.SIGCONT)
            job = training.job.refresh()
            assert job.recoveries == 1
            assert stopped not in {s.address for s in job.plan}
            assert _steps_of(job) == {NUM_STEPS}
            training.check_weights()
        log = (cluster.log_dir / "coordinator.log").read_text()
        assert any(
            "health checks during run" in line and "(step 6)" in line for line in log.splitlines()
        )
        assert "recovering at step 5" in log  # the decided step is rebuilt, then step 6 runs
        recovered = [line for line in log.splitlines() if "recovered in" in line]
        print(f"\nstopped at commit: step 6 took {took:.2f} s; {recovered[-1].strip()}")


def test_commit_refused_on_one_stage_after_the_other_committed(tmp_path: Path) -> None:
    """Rank 1 refuses step 5's commit, carried by step 6's run, once with RESOURCE_EXHAUSTED (a
    final-class error) while rank 0 commits and starts the run: the run is aborted, step 5 is
    completed on rank 1 by an explicit Commit and step 6 runs again, all within the call and
    without a recovery."""
    marker = tmp_path / "fired"
    with _cluster(f"commit-fail:5:1:{marker}") as cluster, cluster.connect() as client:
        training = Training.start(client, "relu-mlp")
        for _ in range(6):
            training.step()
        assert marker.exists(), "the fault never fired"
        assert _steps_of(training.job) == {6}
        assert training.job.refresh().recoveries == 0
        training.check_weights()
        for _ in range(NUM_STEPS - 6):
            training.step()
        assert _steps_of(training.job) == {NUM_STEPS}
        training.check_weights()
        log = (cluster.log_dir / "coordinator.log").read_text()
        assert "a run carrying the commit of step 5 failed" in log
