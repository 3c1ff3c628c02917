"""LoadState's step is checked before any stage is called: a step the coordinator's database
cannot hold (above 2^63-1) is refused with nothing applied, and the job trains on."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

import pipesvc
from pipesvc.core.tensor_codec import named_frames
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support.reference import PROBLEMS

MLP = PROBLEMS["mlp"]


def _requests(
    job_id: str, state: dict[str, torch.Tensor], step: int
) -> Iterator[coordinator_pb2.LoadJobStateRequest]:
    first = True
    for name, tensor in state.items():
        for frame in named_frames(name, tensor):
            request = coordinator_pb2.LoadJobStateRequest(job_id=job_id, frame=frame)
            if first:
                request.step = step
                first = False
            yield request


@pytest.mark.parametrize("step", [2**63, 2**64 - 1])
def test_a_step_above_what_the_database_holds_is_refused_with_nothing_applied(
    cluster: pipesvc.LocalCluster, client: pipesvc.Client, step: int
) -> None:
    with client.create_job(
        model=MLP.model, model_args=MLP.model_args, num_stages=2, loss="mse", seed=3
    ) as job:
        x, y = MLP.batch(8, seed=0)
        job.train_step(x, y)
        before = job.state_dict()
        changed = {k: v + 1 for k, v in before.items()}
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.LoadState(_requests(job.id, changed, step), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(step) in str(refused.value.details())
        after = job.state_dict()
        for key, value in before.items():
            assert torch.equal(after[key], value), key
        assert job.refresh().step == 1
        job.train_step(x, y)  # the job's row is still written: training goes on
        assert job.refresh().step == 2


def test_a_load_whose_checkpoint_cannot_be_written_does_not_count(
    cluster: pipesvc.LocalCluster, client: pipesvc.Client
) -> None:
    """The job's checkpoint directory is replaced by a file, so the checkpoint of the loaded
    state fails after the stages applied it: the load is refused, and the next call rebuilds
    the stages to the state the job's database and step log describe."""
    with client.create_job(
        model=MLP.model, model_args=MLP.model_args, num_stages=2, loss="mse", seed=4
    ) as job:
        for seed in range(2):
            job.train_step(*MLP.batch(8, seed=seed))
        before = job.state_dict()
        checkpoints = cluster.log_dir / "state" / "jobs" / job.id / "checkpoints"
        assert not checkpoints.exists()  # none yet: the first comes at step 10
        checkpoints.write_text("not a directory")
        try:
            with pytest.raises(pipesvc.PipesvcError):
                job.load_state_dict({k: v + 1 for k, v in before.items()})
        finally:
            checkpoints.unlink()
        after = job.state_dict()
        for key, value in before.items():
            torch.testing.assert_close(after[key], value, rtol=1e-6, atol=1e-7)
        assert job.refresh().step == 2 and job.recoveries == 1
