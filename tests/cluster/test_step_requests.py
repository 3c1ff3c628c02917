"""Training steps carry a request id (see [Note: step request ids] in
pipesvc/coordinator/step_request.py): a step sent again under the same id is applied once,
before and after a coordinator restart, and a step whose batch cannot be logged commits nowhere.

Each test checks the weights against the one-process oracle trained on each batch once.
"""

from __future__ import annotations

import sqlite3
import threading

import grpc
import pytest

import pipesvc
from pipesvc.core.tensor_codec import encode
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support.faults import MLP, Run
from tests.support.stage_probe import stage_info


def _request(job: pipesvc.Job, request_id: str, seed: int) -> coordinator_pb2.TrainStepRequest:
    x, y = MLP.batch(8, seed=seed)
    return coordinator_pb2.TrainStepRequest(
        job_id=job.id, inputs=encode(x), targets=encode(y), request_id=request_id
    )


def _send(
    address: str, request: coordinator_pb2.TrainStepRequest
) -> coordinator_pb2.TrainStepResponse:
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return stub.TrainStep(request, timeout=120)


def _stages_at(job: pipesvc.Job, step: int) -> None:
    """Every stage is at ``step`` with nothing prepared (asked of the stages directly)."""
    held = [(i.step, i.pending_run_id) for i in (stage_info(s.address) for s in job.plan)]
    assert held == [(step, 0)] * len(held), f"(step, pending run) per rank: {held}"


def test_a_step_sent_twice_under_one_request_id_is_applied_once() -> None:
    with (
        pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=0)
        request = _request(run.job, "retried-step", seed=0)
        first = _send(cluster.address, request)
        again = _send(cluster.address, request)  # as after a lost reply
        assert (again.loss, again.step) == (first.loss, first.step) == (first.loss, 1)
        assert again.job.step == 1
        x, y = MLP.batch(8, seed=0)
        assert first.loss == pytest.approx(run.reference.step(x, y), rel=1e-5, abs=1e-6)
        # The same id with another batch is refused, naming the id; nothing runs.
        with pytest.raises(grpc.RpcError) as refused:
            _send(cluster.address, _request(run.job, "retried-step", seed=1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "retried-step" in str(refused.value.details())
        # The client's own id, passed again by a caller that retries: applied once too.
        x, y = MLP.batch(8, seed=2)
        loss = run.job.train_step(x, y, request_id="mine")
        assert run.job.train_step(x, y, request_id="mine") == loss
        assert loss == pytest.approx(run.reference.step(x, y), rel=1e-5, abs=1e-6)
        assert run.job.refresh().step == 2
        run.check_weights()


def test_a_retry_after_a_coordinator_restart_gets_the_first_result() -> None:
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        client = cluster.connect()
        run = Run.start(client, checkpoint_every=0)
        request = _request(run.job, "before-restart", seed=0)
        first = _send(cluster.address, request)
        client.close()
        cluster.restart_coordinator(kill=True)  # as if it died before its reply arrived
        again = _send(cluster.address, request)
        assert (again.loss, again.step) == (first.loss, first.step) == (first.loss, 1)
        x, y = MLP.batch(8, seed=0)
        run.reference.step(x, y)
        with cluster.connect() as client:
            run.job = client.get_job(run.job.id)
            assert run.job.step == 1
            run.step()
            run.check_weights()


def test_a_step_whose_batch_cannot_be_logged_commits_on_no_stage() -> None:
    """The step log's directory is replaced by a file, so writing the step's batch fails
    after every stage prepared it: the step is aborted on every stage at once."""
    with (
        pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        run = Run.start(client, checkpoint_every=0)
        run.step()
        steps = cluster.log_dir / "state" / "jobs" / run.job.id / "steps"
        moved = steps.with_name("steps.away")
        steps.rename(moved)
        steps.write_text("not a directory")
        x, y = MLP.batch(8, seed=1)
        with pytest.raises(pipesvc.StepAbortedError, match="step log"):
            run.job.train_step(x, y)
        _stages_at(run.job, 1)  # step 1 committed by the failed run; step 2 nowhere
        assert run.job.refresh().step == 1
        run.check_weights()
        steps.unlink()
        moved.rename(steps)
        run.step()
        assert run.job.refresh().step == 2
        run.check_weights()


def test_a_retry_after_the_decided_step_failed_to_persist_gets_the_first_result() -> None:
    """The state database is held locked by another writer while step 2 is decided, so the
    job's row cannot be written and the call fails after every stage prepared the step. The
    retry under the same id returns step 2's result, writes it, and trains nothing; so does
    one after a coordinator restart."""
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        client = cluster.connect()
        run = Run.start(client, checkpoint_every=0)
        run.step()
        request = _request(run.job, "unlucky", seed=1)
        holder = sqlite3.connect(cluster.log_dir / "state" / "state.sqlite3", isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(grpc.RpcError) as failed:
                _send(cluster.address, request)
            assert "locked" in str(failed.value.details())
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        again = _send(cluster.address, request)
        x, y = MLP.batch(8, seed=1)
        assert again.step == 2
        assert again.loss == pytest.approx(run.reference.step(x, y), rel=1e-5, abs=1e-6)
        client.close()
        cluster.restart_coordinator(kill=True)
        last = _send(cluster.address, request)
        assert (last.loss, last.step) == (again.loss, 2)
        with cluster.connect() as client:
            run.job = client.get_job(run.job.id)
            assert run.job.step == 2
            run.check_weights()


def test_a_train_step_across_a_coordinator_restart_is_applied_once() -> None:
    """The coordinator is killed and restarted while a step is on its way: whether the kill
    lands before the step arrives, while it runs or before its reply, the client sends it again
    under its request id until the new coordinator answers, and it is applied once."""
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        client = cluster.connect()
        run = Run.start(client, checkpoint_every=0)
        run.step()
        x, y = MLP.batch(8, seed=1)
        losses: list[float] = []
        sender = threading.Thread(target=lambda: losses.append(run.job.train_step(x, y)))
        sender.start()
        cluster.restart_coordinator(kill=True)
        sender.join(timeout=120)
        assert losses == [pytest.approx(run.reference.step(x, y), rel=1e-5, abs=1e-6)]
        client.close()
        with cluster.connect() as client:
            run.job = client.get_job(run.job.id)
            assert run.job.step == 2
            run.check_weights()
