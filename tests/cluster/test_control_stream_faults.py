"""Control streams through faults and version skew (see [Note: control stream] in
pipesvc/coordinator/control_stream.py): a stage killed in the middle of a run is found and
replaced as before, the survivors get a stream of the new plan epoch; a stage built before
Control trains beside a new one over the unary calls."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pipesvc
from tests.support.faults import MLP, Run
from tests.support.stage_probe import stage_info


def test_a_stage_killed_mid_run_is_replaced_and_the_streams_follow_the_epoch(
    tmp_path: Path,
) -> None:
    marker = str(tmp_path / "fault-fired")
    with (
        pipesvc.LocalCluster(
            num_stages=3, threads_per_stage=1, stage_args=["--fault-kill", f"forward:3:1:{marker}"]
        ) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=2)
        survivor = run.job.plan[0].address
        for _ in range(6):
            run.step()
        assert os.path.exists(marker), "the fault never fired"
        assert run.job.refresh().recoveries == 1
        run.check_weights()
        info = stage_info(survivor)
        # One stream of plan epoch 1, closed by the recovery, and one of epoch 2.
        assert (info.control_streams_opened, info.control_streams_open) == (2, 1)
        spare = next(s.address for s in run.job.plan if s.address != survivor)
        assert stage_info(spare).control_streams_opened == 1


def test_a_stage_without_control_trains_beside_a_new_one() -> None:
    with pipesvc.LocalCluster(num_stages=1, threads_per_stage=1) as cluster:
        cluster.add_stage(["--no-control-stream"])
        with cluster.connect() as client:
            run = Run.start(client, checkpoint_every=3)
            for _ in range(4):
                run.step()
            batches = [MLP.batch(7, seed=10 + i) for i in range(4)]
            expected = [run.reference.step(x, y) for x, y in batches]
            assert list(run.job.train(batches)) == pytest.approx(expected, rel=1e-5, abs=1e-6)
            run.check_weights()
            opened = sorted(stage_info(s.address).control_streams_opened for s in run.job.plan)
            assert opened == [0, 1]
            assert run.job.refresh().recoveries == 0
