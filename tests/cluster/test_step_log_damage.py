"""A step log record whose bytes the disk changed after their sync (see [Note: step log
segments]): the recovery that needs it stops with an error naming the step, the file and the
checkpoint to go on from, instead of replaying other numbers than the step was decided with;
a new job from that checkpoint then trains on exactly as one process does."""

from __future__ import annotations

import os
import signal
import time

import pytest

import pipesvc
from pipesvc.coordinator import step_log
from pipesvc.errors import FailedPreconditionError
from tests.support.faults import OPTIMIZER, Run, stage_pid
from tests.support.reference import Reference
from tests.support.step_log_rot import flip_payload_bit


def test_a_damaged_record_stops_recovery_with_the_way_on() -> None:
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=3)
        batches = [run.problem.batch(8 + i % 3, seed=i) for i in range(7)]
        for _ in range(5):
            run.step()
        deadline = time.monotonic() + 30
        while run.job.refresh().checkpoint_step != 3:  # written in the background
            assert time.monotonic() < deadline, "no checkpoint at step 3"
            time.sleep(0.05)
        steps = step_log.StepLog(cluster.log_dir / "state" / "jobs" / run.job.id / "steps")
        flip_payload_bit(steps, 5, lambda n: n // 2, 4)  # in the middle of step 5's tensors

        os.kill(stage_pid(run.job.plan[1].address), signal.SIGKILL)
        with pytest.raises(FailedPreconditionError) as info:
            run.job.train_step(*batches[5])
        message = str(info.value)
        assert "step 5's record in the step log" in message
        assert "does not match its checksum" in message
        checkpoint = cluster.log_dir / "state" / "jobs" / run.job.id / "checkpoints"
        assert f"'{checkpoint / 'step-000000003'}'" in message
        with pytest.raises(FailedPreconditionError, match="step 5's record"):
            run.job.train_step(*batches[5])  # the job stays where it stopped, and says so

        # The way on that the error names: a new job from that checkpoint (on the stages the
        # stuck one frees), step for step as one process that trained the same first three.
        run.job.close()
        job = client.create_job(
            model=run.problem.model,
            model_args=run.problem.model_args,
            seed=11,
            num_stages=2,
            num_microbatches=4,
            loss="mse",
            optimizer=OPTIMIZER,
            resume_from=str(checkpoint / "step-000000003"),
        )
        assert job.step == 3
        reference = Reference(run.problem, seed=11, optimizer=OPTIMIZER, clip_grad_norm=None)
        for x, y in batches[:3]:
            reference.step(x, y)
        for x, y in batches[3:]:
            assert job.train_step(x, y) == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
