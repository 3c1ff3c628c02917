"""A coordinator refuses a stage of another pipesvc version (see [Note: wire protocol] in
pipesvc/wire/protocol.py): the stage process exits with a message naming both versions, the
coordinator lists no stage, and a job that then finds none says a stage was refused. A stage
refuses a coordinator of an earlier version the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import pipesvc
from pipesvc.coordinator.server import add_coordinator_service
from pipesvc.coordinator.service import CoordinatorService
from pipesvc.core.version import VERSION
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc
from pipesvc.wire import protocol, transport
from pipesvc.wire.transport import create_server, open_channel


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[str]:
    service = CoordinatorService(tmp_path)
    service.open()
    server, port, _ = create_server("127.0.0.1:0", [lambda s: add_coordinator_service(service, s)])
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait()
        service.shutdown()


def _run_stage(coordinator: str) -> subprocess.CompletedProcess[str]:
    """A real ``pipesvc stage`` process registering with ``coordinator``, run to its end."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "pipesvc", "stage", "--coordinator", coordinator]
    return subprocess.run(
        [*command, "--listen", "127.0.0.1:0", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _stages(address: str) -> list[str]:
    with open_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        reply = stub.ListStages(coordinator_pb2.ListStagesRequest(), timeout=10)
    return [s.address for s in reply.stages]


def test_a_stage_of_another_version_exits_with_both_versions(
    coordinator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator (this process) speaks the next protocol, as after an upgrade of its
    host alone; a real stage process of this version registers with it."""
    monkeypatch.setattr(protocol, "WIRE_PROTOCOL", protocol.WIRE_PROTOCOL + 1)
    stage = _run_stage(coordinator)
    assert stage.returncode == 2, stage.stderr
    ours, theirs = protocol.WIRE_PROTOCOL - 1, protocol.WIRE_PROTOCOL
    assert "FailedPreconditionError: could not register: the stage at 127.0.0.1:" in stage.stderr
    assert (
        f"runs pipesvc {VERSION} (wire protocol {ours}); this coordinator runs pipesvc "
        f"{VERSION} (wire protocol {theirs}). Run the same pipesvc version" in stage.stderr
    )
    assert _stages(coordinator) == []
    # A job then finds no stage, and its error says why.
    with (
        pipesvc.connect(coordinator) as client,
        pytest.raises(pipesvc.UnknownModelError) as no_stage,
    ):
        client.create_job(model="mlp", num_stages=1)
    assert "1 stage(s) were refused at registration" in str(no_stage.value)
    assert f"(wire protocol {theirs})" in str(no_stage.value)


def test_a_stage_from_before_the_protocol_number_is_refused(coordinator: str) -> None:
    """What a stage of an earlier pipesvc sends: no protocol at all."""
    with open_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        request = coordinator_pb2.RegisterStageRequest(
            address="127.0.0.1:7001", device="cpu", memory_bytes=1 << 30, models=["mlp"]
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterStage(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "runs an older pipesvc (wire protocol 1)" in str(refused.value.details())
        assert _stages(coordinator) == []
        request.protocol = protocol.WIRE_PROTOCOL
        stub.RegisterStage(request, timeout=10)
    assert _stages(coordinator) == ["127.0.0.1:7001"]


class _OlderCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """A coordinator from before the protocol check: it accepts any stage and says nothing."""

    def RegisterStage(
        self, request: coordinator_pb2.RegisterStageRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterStageResponse:
        return coordinator_pb2.RegisterStageResponse()


def test_a_stage_refuses_a_coordinator_of_an_earlier_version() -> None:
    server, port, _ = create_server(
        "127.0.0.1:0",
        [
            lambda s: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
                _OlderCoordinator(), s
            )
        ],
    )
    try:
        stage = _run_stage(f"127.0.0.1:{port}")
    finally:
        server.stop(grace=None).wait()
    assert stage.returncode == 2, stage.stderr
    assert (
        f"FailedPreconditionError: the coordinator at 127.0.0.1:{port} runs an older pipesvc "
        f"(wire protocol 1); this stage runs pipesvc {VERSION} (wire protocol "
        f"{protocol.WIRE_PROTOCOL})" in stage.stderr
    )


def test_a_client_of_another_version_is_refused_on_its_first_call(
    coordinator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client (this process) of the next protocol, as after an upgrade of the client's host
    alone: every call, streams included, is refused with both versions and changes nothing; a
    caller that names no pipesvc (grpcurl, an older client) and health checks are served."""
    theirs = protocol.WIRE_PROTOCOL + 1
    monkeypatch.setattr(transport, "user_agent", lambda: f"pipesvc/9.0.0 (wire protocol {theirs})")
    with pipesvc.connect(coordinator) as client:
        with pytest.raises(pipesvc.FailedPreconditionError) as refused:
            client.stages()
        message = str(refused.value)
        assert f"runs pipesvc 9.0.0 (wire protocol {theirs}); this server runs pipesvc " in message
        assert f"{VERSION} (wire protocol {theirs - 1}). Run the same pipesvc version" in message
        with pytest.raises(pipesvc.FailedPreconditionError, match="CreateJob refused"):
            client.create_job(model="mlp", num_stages=1)
    with open_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as stream:
            list(stub.GetState(coordinator_pb2.GetJobStateRequest(job_id="j"), timeout=10))
        assert stream.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "GetState refused: the caller at " in str(stream.value.details())
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(coordinator) as channel:  # names no pipesvc
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        assert list(stub.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=10).jobs) == []
    monkeypatch.undo()
    with pipesvc.connect(coordinator) as client:
        assert client.stages() == [] and client.jobs() == []
