"""The version of the protocol a coordinator and its stages speak to each other.

[Note: wire protocol] A coordinator and its stages must run the same pipesvc: the messages
change between versions (a field added, a rule about when a run may arrive), and a stage of
another version fails in ways that are hard to read, or worse, quietly does something else.
So a stage says which protocol it speaks when it registers, and the coordinator refuses one
that speaks another with a message naming both versions (``check_stage``); the stage then
exits, or, on a heartbeat, logs the refusal. The coordinator's reply says its own protocol, so
a stage also refuses a coordinator of another version, one from before the check included
(``check_coordinator``). The coordinator remembers a refusal for a minute
(``StageRegistry.refuse``), and a job that then finds too few stages says so in its error.
Every channel a pipesvc process opens also names its protocol and version in its gRPC user
agent (``user_agent``), and every pipesvc server refuses a call that names another protocol
(``wire.interceptors.ProtocolInterceptor``): a client of another version gets the same message
on its first call, where it would otherwise fail on a field or a rule it does not know. A
caller that names no pipesvc (grpcurl, a client from before the agent) is let through; a
coordinator from before the agent checks no client.
The number is ``WIRE_PROTOCOL``; it goes up with any change to the messages in ``protos/`` or
to what a peer may expect of them. ``tests/unit/test_wire_protocol.py`` holds a digest of the
messages, so a change to them without a new number fails the tests.
"""

from __future__ import annotations

import re

from pipesvc.core.version import VERSION
from pipesvc.errors import FailedPreconditionError

WIRE_PROTOCOL = 2
"""This pipesvc's protocol between coordinator and stages (1: before stages said theirs)."""
MAX_ECHO = 80
"""Characters of a peer's address or version a refusal repeats (they come off the wire)."""


_AGENT = re.compile(r"(?:^|\s)pipesvc/(\S+) \(wire protocol (\d{1,9})\)")


def user_agent() -> str:
    """What a pipesvc channel puts first in its gRPC user agent (gRPC appends its own)."""
    return f"pipesvc/{VERSION} (wire protocol {WIRE_PROTOCOL})"


def agent_protocol(agent: str) -> tuple[int, str] | None:
    """The wire protocol and version a caller's user agent names, or None for a caller that
    names no pipesvc."""
    match = _AGENT.search(agent)
    return None if match is None else (int(match.group(2)), match.group(1))


def names_another(agent: str) -> bool:
    """Whether a caller's user agent names a pipesvc of another protocol."""
    named = agent_protocol(agent)
    return named is not None and named[0] != WIRE_PROTOCOL


def caller_refusal(peer: str, agent: str) -> str:
    """What a server tells a caller at ``peer`` whose user agent ``agent`` names a pipesvc of
    another protocol (``names_another``)."""
    named = agent_protocol(agent) or (0, "")
    return _mismatch("caller", "server", peer, *named)


def _printable(text: str) -> str:
    """``text`` as a message may repeat it: at most ``MAX_ECHO`` characters, each printable."""
    return "".join(c if c.isprintable() else "?" for c in text[:MAX_ECHO])


def check_stage(address: str, protocol: int, version: str) -> None:
    """The coordinator's check of a registering stage at ``address``.

    Raises:
        FailedPreconditionError: the stage speaks another protocol than ``WIRE_PROTOCOL``.
    """
    _check("stage", "coordinator", address, protocol, version)


def check_coordinator(address: str, protocol: int, version: str) -> None:
    """A stage's check of the coordinator at ``address`` that accepted it (a coordinator from
    before the check accepts any stage and says nothing: protocol 0).

    Raises:
        FailedPreconditionError: the coordinator speaks another protocol.
    """
    _check("coordinator", "stage", address, protocol, version)


def _check(peer: str, me: str, address: str, protocol: int, version: str) -> None:
    if protocol != WIRE_PROTOCOL:
        raise FailedPreconditionError(_mismatch(peer, me, address, protocol, version))


def _mismatch(peer: str, me: str, address: str, protocol: int, version: str) -> str:
    theirs = f"pipesvc {_printable(version)}" if version else "an older pipesvc"
    return (
        f"the {peer} at {_printable(address)} runs {theirs} (wire protocol {protocol or 1}); "
        f"this {me} runs pipesvc {VERSION} (wire protocol {WIRE_PROTOCOL}). Run the same "
        "pipesvc version on the coordinator, its stages and its clients"
    )
