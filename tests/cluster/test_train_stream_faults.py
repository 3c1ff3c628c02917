"""``job.train`` through faults: a stage killed in the middle of a stream, and a coordinator
killed between two of its steps, still give every step exactly once, with the one-process
oracle's losses and weights (see [Note: stream reconnect] in pipesvc/wire/step_stream.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

import pipesvc
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from tests.support.faults import MLP, Run

NUM_STEPS = 12


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [MLP.batch(8 + i % 3, seed=i) for i in range(NUM_STEPS)]


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_a_stage_killed_mid_stream_costs_no_step(tmp_path: Path, when: str) -> None:
    """Rank 1 dies in step 5 while later steps wait on the coordinator: a spare takes its
    place, the logged steps are replayed, and the stream goes on with exact losses."""
    marker = str(tmp_path / "fault-fired")
    with (
        pipesvc.LocalCluster(
            num_stages=3, threads_per_stage=1, stage_args=["--fault-kill", f"{when}:5:1:{marker}"]
        ) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=3)
        batches = _batches()
        losses = list(run.job.train(batches))
        assert os.path.exists(marker), "the fault never fired"
        assert losses == pytest.approx(
            [run.reference.step(x, y) for x, y in batches], rel=1e-5, abs=1e-6
        )
        assert run.job.step == NUM_STEPS
        assert run.job.recoveries == 1
        run.check_weights()


def test_a_coordinator_killed_between_two_steps_of_a_stream_loses_none() -> None:
    """The coordinator is killed after the sixth loss, while the client is still reading its
    next batch (so no step is in flight): the client's call fails, it opens one to the
    restarted coordinator, which reconciles with the stages, and every step is applied once,
    in order, with the one-process oracle's losses."""
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        client = cluster.connect()
        run = Run.start(client, checkpoint_every=4)
        batches = _batches()
        restarted = threading.Event()

        def held_back() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for number, batch in enumerate(batches):
                if number == 6:
                    assert restarted.wait(120)
                yield batch

        losses = []
        for number, loss in enumerate(run.job.train(held_back()), start=1):
            losses.append(loss)
            if number == 6:
                cluster.restart_coordinator(kill=True)
                restarted.set()
        assert losses == pytest.approx(
            [run.reference.step(x, y) for x, y in batches], rel=1e-5, abs=1e-6
        )
        assert run.job.step == NUM_STEPS
        client.close()
        with cluster.connect() as client:
            run.job = client.get_job(run.job.id)
            assert run.job.step == NUM_STEPS
            run.step()
            run.check_weights()


def test_a_run_a_killed_coordinator_left_on_one_stage_does_not_block_its_successor() -> None:
    """A coordinator killed while it sent a run reached only the last stage, which waits for
    activations that will never come, holding its run lock. The restarted coordinator aborts
    that run when it reconciles, so the next step runs at once (before, it waited out the
    stage's receive deadline of minutes, past this client's 60 s) and stays exact."""
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        client = cluster.connect(timeout_s=60)
        run = Run.start(client, checkpoint_every=0)
        for _ in range(3):
            run.step()
        run.job.refresh()  # flushes the deferred commit: the stages are idle at step 3
        last = run.job.plan[-1].address
        with grpc.insecure_channel(last) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            info = stub.Info(stage_pb2.InfoRequest(), timeout=5)
            orphan = stage_pb2.RunStepRequest(
                job_id=run.job.id,
                plan_epoch=info.plan_epoch,
                run_id=info.last_run_id + 1,
                mode=stage_pb2.INFER,
                num_microbatches=1,
            )
            errors: list[grpc.RpcError] = []

            def send() -> None:
                try:
                    stub.RunStep(orphan, timeout=600)
                except grpc.RpcError as exc:
                    errors.append(exc)

            sender = threading.Thread(target=send)
            sender.start()
            deadline = time.monotonic() + 30
            while stub.Info(stage_pb2.InfoRequest(), timeout=5).last_run_id < orphan.run_id:
                assert time.monotonic() < deadline, "the orphan run never started"
                time.sleep(0.05)
            client.close()
            cluster.restart_coordinator(kill=True)
            with cluster.connect(timeout_s=60) as successor:
                run.job = successor.get_job(run.job.id)
                for _ in range(2):
                    run.step()
                run.check_weights()
            sender.join(30)
            assert not sender.is_alive() and len(errors) == 1, errors
