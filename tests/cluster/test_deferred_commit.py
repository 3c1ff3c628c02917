"""The deferred commit (see [Note: deferred commit] in pipesvc/coordinator/ledger.py).

After ``train_step`` returns step N, every stage holds step N prepared and not yet committed
until the next run carries the commit or a call that reads weights flushes it. Each test first
checks, on the stages themselves, that the commit is in fact still pending, then that a lost
stage, a killed coordinator, or a read right after the step still sees exactly the weights of
the one-process oracle.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import pipesvc
from tests.support.faults import FAULT_TOL, MLP, OPTIMIZER, Run, stage_pid
from tests.support.reference import Reference
from tests.support.stage_probe import stage_info


def _assert_held(job: pipesvc.Job, step: int) -> None:
    """Every stage of the job is at ``step - 1`` with step ``step``'s run pending (asked of the
    stages directly: the coordinator's GetJob would flush the commit)."""
    infos = [stage_info(s.address) for s in job.plan]
    held = [(i.step, bool(i.pending_run_id)) for i in infos]
    assert held == [(step - 1, True)] * len(infos), f"(step, pending) per rank: {held}"


def _assert_committed(job: pipesvc.Job, step: int) -> None:
    infos = [stage_info(s.address) for s in job.plan]
    held = [(i.step, i.pending_run_id) for i in infos]
    assert held == [(step, 0)] * len(infos), f"(step, pending run) per rank: {held}"


def test_stage_killed_while_holding_a_deferred_commit_recovers_to_the_oracle() -> None:
    """Rank 1 dies after step 3 returned, before step 4: step 3 was decided (its batch logged),
    so recovery restores the step-2 checkpoint, replays step 3, and step 4 runs on."""
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=2)
        for _ in range(3):
            run.step()
        _assert_held(run.job, 3)
        os.kill(stage_pid(run.job.plan[1].address), signal.SIGKILL)
        for _ in range(2):
            run.step()
        job = run.job.refresh()
        assert job.step == 5 and job.recoveries == 1
        _assert_committed(job, 5)
        run.check_weights()


def test_reads_right_after_a_step_see_its_commit() -> None:
    """forward carries the pending commit and state reads flush it: each sees the weights after
    the step just returned, never those before it; a periodic checkpoint is the snapshot the
    run carrying its step's commit takes."""
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=4)
        run.step()
        _assert_held(run.job, 1)
        x, _ = MLP.batch(5, seed=99)
        with torch.no_grad():
            expected = run.reference.model(x)
        torch.testing.assert_close(run.job.forward(x), expected, **FAULT_TOL)
        _assert_committed(run.job, 1)

        run.step()
        _assert_held(run.job, 2)
        run.check_weights()  # GetState flushes first
        _assert_committed(run.job, 2)

        run.step()
        run.step()  # step 4: its commit rides on step 5's run, with a snapshot for the checkpoint
        _assert_held(run.job, 4)
        run.step()
        _assert_held(run.job, 5)
        manifest = (
            cluster.log_dir / "state" / "jobs" / run.job.id / "checkpoints" / "step-000000004"
        ) / "manifest.json"
        deadline = time.monotonic() + 30
        while not manifest.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # written from the snapshots while step 5 trained
        assert manifest.exists()
        # Recovery restores the step-4 checkpoint and replays step 5: had the snapshot held
        # step-3 (or step-5) weights, the weights would differ from the oracle's.
        os.kill(stage_pid(run.job.plan[0].address), signal.SIGKILL)
        run.step()
        assert run.job.refresh().recoveries == 1
        run.check_weights()


@pytest.mark.parametrize("clip", [None, 0.5], ids=["commit", "clipped-replay"])
def test_killed_coordinator_with_a_decided_step_not_flushed(clip: float | None) -> None:
    """The coordinator dies after step 3 returned, its commit still pending on every stage.
    The restarted one finds step 3 in its database: it commits the pending run on the stages
    (or, when the job clips gradients, whose scale was not saved, rebuilds and replays step 3
    from the log); then training goes on exactly."""
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        client = cluster.connect()
        job = client.create_job(
            model=MLP.model,
            model_args=MLP.model_args,
            seed=11,
            num_stages=2,
            num_microbatches=4,
            loss="mse",
            optimizer=OPTIMIZER,
            checkpoint_every=2,
            clip_grad_norm=clip,
        )
        run = Run(job, Reference(MLP, seed=11, optimizer=OPTIMIZER, clip_grad_norm=clip))
        for _ in range(3):
            run.step()
        _assert_held(job, 3)
        client.close()
        cluster.restart_coordinator(kill=True)
        _assert_held(job, 3)  # nothing flushed it before the coordinator died
        with cluster.connect() as client:
            run.job = client.get_job(job.id)
            assert run.job.step == 3
            for _ in range(2):
                run.step()
            run.check_weights()
            assert run.job.refresh().recoveries == 0
        log = (cluster.log_dir / "coordinator.log").read_text()
        if clip is None:
            assert "resumed with its stages as they were (step 3)" in log
        else:
            assert "stages disagree with the saved state; rebuilding" in log


def test_killed_coordinator_and_stage_with_a_decided_step_not_flushed() -> None:
    """The coordinator and then rank 1 die after step 3 returned, its commit pending. The
    restarted coordinator waits for rank 1 in vain, rebuilds on the spare from the step-2
    checkpoint and replays step 3 from the log; training goes on exactly."""
    with pipesvc.LocalCluster(num_stages=3, threads_per_stage=1) as cluster:
        client = cluster.connect()
        run = Run.start(client, checkpoint_every=2)
        for _ in range(3):
            run.step()
        _assert_held(run.job, 3)
        job_id, lost = run.job.id, run.job.plan[1].address
        client.close()
        cluster.restart_coordinator(kill=True)
        os.kill(stage_pid(lost), signal.SIGKILL)
        with cluster.connect() as client:
            run.job = client.get_job(job_id)
            assert run.job.step == 3
            for _ in range(2):
                run.step()
            job = run.job.refresh()
            assert lost not in {s.address for s in job.plan}
            _assert_committed(job, 5)
            run.check_weights()
        log = (cluster.log_dir / "coordinator.log").read_text()
        assert "stages disagree with the saved state; rebuilding" in log
