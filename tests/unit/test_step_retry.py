"""The client's retries of a training step (see [Note: step request ids] in
pipesvc/coordinator/step_request.py): a step whose call failed in transport is sent again
under the same request id; an error the coordinator sent itself is not retried. A real gRPC
server with a scripted servicer stands in for the coordinator (the seam)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

import pipesvc
from pipesvc.client import training
from pipesvc.core.config import JobConfig, config_to_proto
from pipesvc.errors import StageUnavailableError
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc
from pipesvc.wire.rpc_status import abort_with
from pipesvc.wire.transport import create_server

INFO = coordinator_pb2.JobInfo(job_id="j", spec=config_to_proto(JobConfig(model="mlp")))


class Scripted(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Fails the first ``drop`` TrainSteps as a lost connection would (UNAVAILABLE with no
    error class of pipesvc's), or with the coordinator's own StageUnavailableError."""

    def __init__(self, drop: int, *, own_error: bool = False) -> None:
        self.drop = drop
        self.own_error = own_error
        self.request_ids: list[str] = []

    def TrainStep(
        self, request: coordinator_pb2.TrainStepRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.TrainStepResponse:
        self.request_ids.append(request.request_id)
        if len(self.request_ids) <= self.drop:
            if self.own_error:
                abort_with(context, StageUnavailableError("stage 1 is gone"))
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        step = len(self.request_ids)
        return coordinator_pb2.TrainStepResponse(loss=0.5, step=step, job=INFO)


@pytest.fixture
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "RETRY_PAUSE_S", 0.0)


def _job(servicer: Scripted) -> Iterator[pipesvc.Job]:
    server, port, _ = create_server(
        "127.0.0.1:0",
        [lambda s: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, s)],
    )
    try:
        with pipesvc.connect(f"127.0.0.1:{port}", timeout_s=30) as client:
            yield pipesvc.Job(client, INFO)
    finally:
        server.stop(None)


@pytest.mark.usefixtures("no_pause")
def test_a_step_lost_in_transport_is_sent_again_under_its_request_id() -> None:
    servicer = Scripted(drop=2)
    for job in _job(servicer):
        assert job.train_step(torch.zeros(2, 16), torch.zeros(2, 8)) == 0.5
        job.train_step(torch.zeros(2, 16), torch.zeros(2, 8))
    first, second, third, fourth = servicer.request_ids
    assert first == second == third and first  # one step, three tries, one id
    assert fourth != first  # the next step has an id of its own


@pytest.mark.usefixtures("no_pause")
def test_a_caller_passes_its_own_request_id() -> None:
    servicer = Scripted(drop=0)
    for job in _job(servicer):
        job.train_step(torch.zeros(2, 16), torch.zeros(2, 8), request_id="caller-7")
    assert servicer.request_ids == ["caller-7"]


@pytest.mark.usefixtures("no_pause")
def test_an_error_the_coordinator_sent_is_not_retried() -> None:
    servicer = Scripted(drop=1, own_error=True)
    for job in _job(servicer):
        with pytest.raises(StageUnavailableError, match="stage 1 is gone"):
            job.train_step(torch.zeros(2, 16), torch.zeros(2, 8))
    assert len(servicer.request_ids) == 1
