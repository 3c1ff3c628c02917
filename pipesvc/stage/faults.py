"""Fault injection for tests: a stage that SIGKILLs itself at a chosen point (no gRPC here).

``--fault-kill WHEN:STEP:RANK:MARKER`` kills the stage that is rank RANK of its job when
training step STEP reaches WHEN: ``forward`` (the forward of micro-batch 1, or 0 with one
micro-batch), ``backward`` (the same micro-batch's backward) or ``commit`` (on receiving the
commit, after every backward is done). The MARKER file is created first and makes the fault
fire once per cluster, so the stage that takes over does not kill itself too.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from pipesvc.errors import InvalidArgumentError

logger = logging.getLogger(__name__)
WHEN = ("forward", "backward", "commit")


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultKill:
    """Where a stage kills itself."""

    when: str
    step: int
    rank: int
    marker: str

    @classmethod
    def parse(cls, text: str) -> FaultKill:
        """Parses ``WHEN:STEP:RANK:MARKER``.

        Raises:
            InvalidArgumentError: malformed text.
        """
        parts = text.split(":", 3)
        if len(parts) != 4 or parts[0] not in WHEN or not parts[1].isdigit():
            raise InvalidArgumentError(
                f"--fault-kill {text!r} must be WHEN:STEP:RANK:MARKER with WHEN in {WHEN}"
            )
        if not parts[2].isdigit() or not parts[3]:
            raise InvalidArgumentError(f"--fault-kill {text!r}: RANK and MARKER are needed")
        return cls(when=parts[0], step=int(parts[1]), rank=int(parts[2]), marker=parts[3])

    def check(self, *, when: str, step: int, rank: int, microbatch: int, last_mb: int) -> None:
        """Kills this process if the fault matches and has not fired yet in the cluster."""
        if (when, step, rank) != (self.when, self.step, self.rank):
            return
        if when != "commit" and microbatch != min(1, last_mb):
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        logger.warning("fault injection: killing myself at %s of step %d", when, step)
        os.kill(os.getpid(), signal.SIGKILL)
