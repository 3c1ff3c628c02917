"""The version of the protocol a coordinator and its stages speak to each other.

[Note: wire protocol] A coordinator and its stages must run the same pipesvc: the messages
change between versions (a field added, a rule about when a run may arrive), and a stage of
another version fails in ways that are hard to read, or worse, quietly does something else.
So a stage says which protocol it speaks when it registers, and the coordinator refuses one
that speaks another with a message naming both versions (``check_stage``); the stage then
exits, or, on a heartbeat, logs the refusal. The coordinator remembers a refusal for a minute
(``StageRegistry.refuse``), and a job that then finds too few stages says so in its error.
The number is ``WIRE_PROTOCOL``; it goes up with any change to the messages in ``protos/`` or
to what a peer may expect of them. ``tests/unit/test_wire_protocol.py`` holds a digest of the
messages, so a change to them without a new number fails the tests.
"""

from __future__ import annotations

from pipesvc.core.version import VERSION
from pipesvc.errors import FailedPreconditionError

WIRE_PROTOCOL = 2
"""This pipesvc's protocol between coordinator and stages (1: before stages said theirs)."""


def check_stage(address: str, protocol: int, version: str) -> None:
    """Refuses a stage at ``address`` that speaks another protocol.

    Raises:
        FailedPreconditionError: ``protocol`` is not ``WIRE_PROTOCOL``.
    """
    if protocol == WIRE_PROTOCOL:
        return
    theirs = f"pipesvc {version}" if version else "an older pipesvc"
    raise FailedPreconditionError(
        f"the stage at {address} runs {theirs} (wire protocol {protocol or 1}); this "
        f"coordinator runs pipesvc {VERSION} (wire protocol {WIRE_PROTOCOL}). Run the same "
        "pipesvc version on the coordinator and every stage"
    )
