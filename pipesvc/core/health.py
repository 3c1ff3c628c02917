"""A server's health as the coordinator, the stages, the client and the CLI name it.

The names are those of grpc.health.v1's ServingStatus, plus UNREACHABLE for a server that did
not answer the check at all. They travel as plain strings (StageStatus.health, the CLI's
tables and exit codes), so the enum's members are strings equal to their names.
"""

from __future__ import annotations

import enum
import sys

__all__ = ["Health"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10 has no StrEnum

    class StrEnum(str, enum.Enum):
        """enum.StrEnum of Python 3.11: members print and format as their value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


class Health(StrEnum):
    """One health check's answer."""

    SERVING = "SERVING"
    """Answers and takes work."""
    NOT_SERVING = "NOT_SERVING"
    """Answers but is leaving (draining): its layers move elsewhere."""
    UNKNOWN = "UNKNOWN"
    """Answers without a status (grpc.health.v1's UNKNOWN)."""
    SERVICE_UNKNOWN = "SERVICE_UNKNOWN"
    """Answers, but has no such service (grpc.health.v1's SERVICE_UNKNOWN)."""
    UNREACHABLE = "UNREACHABLE"
    """Did not answer: dead, hung, cut off, or refused the call."""

    @classmethod
    def from_wire(cls, name: str) -> Health:
        """The member named ``name`` (a status a peer sent); UNKNOWN for a name this version
        does not know, so a newer peer's status shows rather than failing the whole table."""
        try:
            return cls(name)
        except ValueError:
            return cls.UNKNOWN
