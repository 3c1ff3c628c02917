"""Connection mistakes, on real servers: each error names what could not be reached and what to
check, and a stage's address given for the coordinator's is recognised as a stage's."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
import trustme

import pipesvc
from pipesvc.coordinator.service import CoordinatorService
from pipesvc.stage.server import register
from pipesvc.v1 import coordinator_pb2_grpc
from pipesvc.wire.security import Security, TLSConfig
from pipesvc.wire.transport import create_server
from tests.support.faults import free_port

TOKEN = "s3cret-connect-token"


@pytest.fixture(scope="module")
def cluster() -> Iterator[pipesvc.LocalCluster]:
    """A plaintext cluster of one stage."""
    with pipesvc.LocalCluster(num_stages=1, threads_per_stage=1) as running:
        yield running


@pytest.fixture(scope="module")
def stage_address(cluster: pipesvc.LocalCluster) -> str:
    with cluster.connect(timeout_s=30) as client:
        (stage,) = client.stages()
    return stage.address


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_coordinator(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A coordinator with a token and mutual TLS, in this process."""
    leaf = ca.issue_cert("127.0.0.1")
    tls = TLSConfig(
        cert=b"".join(blob.bytes() for blob in leaf.cert_chain_pems),
        key=leaf.private_key_pem.bytes(),
        ca=ca.cert_pem.bytes(),
    )
    security = Security(token=TOKEN, tls=tls)
    service = CoordinatorService(tmp_path_factory.mktemp("coordinator"), security=security)
    service.open()
    server, port, _ = create_server(
        "127.0.0.1:0",
        [lambda s: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(service, s)],
        security=security,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait()
        service.shutdown()


def _client_tls(ca: trustme.CA, *, certificate: bool) -> TLSConfig:
    if not certificate:
        return TLSConfig(ca=ca.cert_pem.bytes())
    leaf = ca.issue_cert("client")
    return TLSConfig(
        ca=ca.cert_pem.bytes(),
        cert=b"".join(blob.bytes() for blob in leaf.cert_chain_pems),
        key=leaf.private_key_pem.bytes(),
    )


def test_a_wrong_port_names_the_coordinator_and_what_to_check() -> None:
    address = f"127.0.0.1:{free_port()}"
    with (
        pipesvc.connect(address, timeout_s=10) as client,
        pytest.raises(pipesvc.StageUnavailableError) as caught,
    ):
        client.stages()
    message = str(caught.value)
    assert message.startswith(
        f"cannot reach the coordinator at {address}: nothing accepts connections there. "
        "Check the address and the port, and that the coordinator is running."
    )
    assert type(caught.value) is pipesvc.StageUnavailableError


def test_a_stage_address_given_as_the_coordinator_is_recognised(stage_address: str) -> None:
    with (
        pipesvc.connect(stage_address, timeout_s=10) as client,
        pytest.raises(pipesvc.WrongServiceError) as caught,
    ):
        client.create_job(model="mlp", num_stages=1, loss="mse")
    assert str(caught.value).startswith(
        f"{stage_address} is a pipesvc stage, not a coordinator: give the coordinator's address"
    )
    assert isinstance(caught.value, pipesvc.StageUnavailableError)  # it is not reachable there


def test_a_stage_told_to_register_at_a_stage_is_told_so(stage_address: str) -> None:
    with pytest.raises(pipesvc.WrongServiceError, match="is a pipesvc stage, not a coordinator"):
        register(stage_address, "127.0.0.1:1", torch.device("cpu"), 10.0, Security(), 1 << 30)


def test_tls_on_the_client_only_is_named(stage_address: str, ca: trustme.CA) -> None:
    # The stage's cluster runs in plaintext; its stage answers the probe as well as any server.
    with (
        pipesvc.connect(stage_address, tls=_client_tls(ca, certificate=False), timeout_s=10) as c,
        pytest.raises(pipesvc.StageUnavailableError, match=re.escape(
            f"cannot reach the coordinator at {stage_address}: the TLS handshake failed: the "
            "coordinator probably runs without TLS, and this client uses TLS"
        )),
    ):  # fmt: skip
        c.stages()


def test_tls_on_the_server_only_is_named(tls_coordinator: str) -> None:
    with (
        pipesvc.connect(tls_coordinator, token=TOKEN, timeout_s=10) as client,
        pytest.raises(pipesvc.StageUnavailableError, match=re.escape(
            "the coordinator probably runs with TLS, and this client does not"
        )),
    ):  # fmt: skip
        client.stages()


def test_a_missing_client_certificate_is_named(tls_coordinator: str, ca: trustme.CA) -> None:
    tls = _client_tls(ca, certificate=False)
    with (
        pipesvc.connect(tls_coordinator, token=TOKEN, tls=tls, timeout_s=10) as client,
        pytest.raises(pipesvc.StageUnavailableError, match="wants a client certificate"),
    ):
        client.stages()


def test_a_wrong_token_says_to_check_the_token(tls_coordinator: str, ca: trustme.CA) -> None:
    tls = _client_tls(ca, certificate=True)
    with pipesvc.connect(tls_coordinator, token=TOKEN, tls=tls, timeout_s=10) as client:
        assert client.stages() == []
    with (
        pipesvc.connect(tls_coordinator, token="wrong", tls=tls, timeout_s=10) as client,
        pytest.raises(pipesvc.UnauthenticatedError) as caught,
    ):
        client.stages()
    assert "ListStages refused: the call carried a wrong token" in str(caught.value)
    assert f"Check the token for the coordinator at {tls_coordinator}" in str(caught.value)


def test_typed_errors_of_a_reachable_coordinator_are_unchanged(
    cluster: pipesvc.LocalCluster,
) -> None:
    with cluster.connect(timeout_s=30) as client, pytest.raises(pipesvc.NotFoundError) as e:
        client.get_job("no-such-job")
    assert "no-such-job" in str(e.value) and "cannot reach" not in str(e.value)
