"""Fault injection for tests: a stage that fails itself at a chosen point (no gRPC here).

``--fault-kill WHEN[-ACTION]:STEP:RANK:MARKER`` makes the stage that is rank RANK of its job
fail when training step STEP reaches WHEN: ``forward`` (the forward of micro-batch 1, or 0 with
one micro-batch), ``backward`` (the same micro-batch's backward), ``commit`` (on receiving the
commit, after every backward is done) or ``checkpoint`` (while its state streams into the
checkpoint of step STEP, after the first tensor). One point is not in training: ``prefill``
fires at the forward of micro-batch 1 of this stage's STEP-th generation run of several
micro-batches (a long prompt's second chunk, with its first in the caches; see [Note: chunked
prefill]). ACTION is ``kill`` (SIGKILL, the default), ``stop`` (SIGSTOP: a hung stage, until
someone sends SIGCONT) or ``fail`` (the call fails with RESOURCE_EXHAUSTED, as from a
concurrency cap, and the stage carries on). The MARKER file is created first and makes the
fault fire once per cluster, so the stage that takes over (or the retried call) does not fail
too. Only this command-line flag, meant for tests, enables it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

from pipesvc.errors import InvalidArgumentError, ResourceExhaustedError

logger = logging.getLogger(__name__)
WHEN = ("forward", "backward", "commit", "checkpoint", "prefill")
ACTIONS = ("kill", "stop", "fail")


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultKill:
    """Where and how a stage fails itself."""

    when: str
    step: int
    rank: int
    marker: str
    action: str = "kill"

    @classmethod
    def parse(cls, text: str) -> FaultKill:
        """Parses ``WHEN[-ACTION]:STEP:RANK:MARKER``.

        Raises:
            InvalidArgumentError: malformed text.
        """
        parts = text.split(":", 3)
        when, _, action = parts[0].partition("-")
        action = action or "kill"
        if len(parts) != 4 or when not in WHEN or action not in ACTIONS or not parts[1].isdigit():
            raise InvalidArgumentError(
                f"--fault-kill {text!r} must be WHEN[-ACTION]:STEP:RANK:MARKER with WHEN in "
                f"{WHEN} and ACTION in {ACTIONS}"
            )
        if not parts[2].isdigit() or not parts[3]:
            raise InvalidArgumentError(f"--fault-kill {text!r}: RANK and MARKER are needed")
        return cls(
            when=when, step=int(parts[1]), rank=int(parts[2]), marker=parts[3], action=action
        )

    def check(self, *, when: str, step: int, rank: int, microbatch: int, last_mb: int) -> None:
        """Fails as configured if the fault matches and has not fired yet in the cluster.

        Raises:
            ResourceExhaustedError: the fault fires and its action is ``fail``.
        """
        if (when, step, rank) != (self.when, self.step, self.rank):
            return
        if when != "commit" and microbatch != min(1, last_mb):
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        logger.warning("fault injection: %s at %s of step %d", self.action, when, step)
        if self.action == "fail":
            raise ResourceExhaustedError(f"fault injection: {when} of step {step} refused")
        # Sent to this thread, so that it stops (or dies) before it can go on: a signal sent to
        # the process may be taken by another thread, and this one could finish the call first.
        signum = signal.SIGSTOP if self.action == "stop" else signal.SIGKILL
        signal.pthread_kill(threading.get_ident(), signum)
