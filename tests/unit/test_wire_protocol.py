"""The wire protocol's number (see [Note: wire protocol] in pipesvc/wire/protocol.py): it
changes with the messages, and a coordinator refuses a stage that speaks another."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib

from pipesvc.core.version import VERSION
from pipesvc.errors import FailedPreconditionError
from pipesvc.wire import protocol
from pipesvc.wire.protocol import WIRE_PROTOCOL, check_coordinator, check_stage

REPO = Path(__file__).resolve().parents[2]
PROTO_DIGEST = "a0d8671d10c3b3c3eb3f4c98ae7a0c948a00c19ee771d4905345dcf81ad940e6"
"""The digest of ``protos/`` (comments and blank lines left out) at ``WIRE_PROTOCOL``."""


def _digest() -> str:
    sha = hashlib.sha256()
    for path in sorted((REPO / "protos").rglob("*.proto")):
        sha.update(path.relative_to(REPO).as_posix().encode())
        for line in path.read_text().splitlines():
            code = re.sub(r"//.*", "", line).strip()
            if code:
                sha.update(code.encode() + b"\n")
    return sha.hexdigest()


def test_the_messages_have_not_changed_without_a_new_protocol_number() -> None:
    assert (WIRE_PROTOCOL, _digest()) == (2, PROTO_DIGEST), (
        "the messages in protos/ changed: raise WIRE_PROTOCOL in pipesvc/wire/protocol.py, "
        f"and set this test's pair to ({WIRE_PROTOCOL + 1}, {_digest()!r})"
    )


def test_the_package_and_its_metadata_have_one_version() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == VERSION


@pytest.mark.parametrize(
    ("check", "peer", "me"),
    [(check_stage, "stage", "coordinator"), (check_coordinator, "coordinator", "stage")],
)
def test_a_peer_of_another_protocol_is_refused_with_both_versions(
    check: Callable[[str, int, str], None], peer: str, me: str
) -> None:
    """The coordinator's check of a stage, and a stage's of the coordinator."""
    check("10.0.0.2:7001", WIRE_PROTOCOL, VERSION)
    with pytest.raises(FailedPreconditionError) as older:
        check("10.0.0.2:7001", 0, "")
    assert str(older.value).startswith(
        f"the {peer} at 10.0.0.2:7001 runs an older pipesvc (wire protocol 1); this {me} "
        f"runs pipesvc {VERSION} (wire protocol {WIRE_PROTOCOL})"
    )
    with pytest.raises(FailedPreconditionError, match=r"runs pipesvc 9\.0 \(wire protocol 9\)"):
        check("10.0.0.2:7001", 9, "9.0")


def test_a_refusal_repeats_only_a_short_printable_part_of_what_the_stage_sent() -> None:
    with pytest.raises(FailedPreconditionError) as refused:
        check_stage("h:1\nforged log line" + "x" * 500, 9, "9.0\r\n" + "y" * 500)
    message = str(refused.value)
    assert "\n" not in message and "\r" not in message
    assert "h:1?forged log line" in message and "x" * 81 not in message and "y" * 81 not in message


def test_a_callers_user_agent_names_its_protocol_or_no_pipesvc() -> None:
    """What gRPC sends: our agent first, its own after; callers that name no pipesvc, or name
    it badly, are not taken for one."""
    ours = f"{protocol.user_agent()} grpc-python/1.70.0 grpc-c/45.0.0 (linux; chttp2)"
    assert protocol.agent_protocol(ours) == (protocol.WIRE_PROTOCOL, VERSION)
    assert not protocol.names_another(ours)
    other = "pipesvc/9.1.0 (wire protocol 7) grpc-python/1.70.0"
    assert protocol.agent_protocol(other) == (7, "9.1.0") and protocol.names_another(other)
    for agent in (
        "",
        "grpc-python/1.70.0",
        "grpcurl/1.9",
        "pipesvc/1.0 (wire protocol x)",
        "notpipesvc/1.0 (wire protocol 9)",
        "pipesvc/1.0 (wire protocol 1234567890)",
    ):
        assert protocol.agent_protocol(agent) is None and not protocol.names_another(agent)
    assert protocol.caller_refusal("ipv4:10.0.0.9:4242", other).startswith(
        "the caller at ipv4:10.0.0.9:4242 runs pipesvc 9.1.0 (wire protocol 7); this server runs"
    )
