"""A training job's progress in the log: a line per interval, not a line per step.

[Note: step lines] A job that commits hundreds of small steps a second used to log a line for
each, hundreds of lines a second in the coordinator's log (and in journald or ``docker logs``
behind it). ``StepLines`` logs a step's line at INFO when it is the job's first since the
coordinator took the job, or when the last line is ``every_s`` old; such a line also says how
many steps committed since the one before it, and at what rate (checkpoints, recoveries and
moves have lines of their own). Every other step is logged at DEBUG (``--log-level debug`` shows
them all), which costs a level check and nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

EVERY_S = 10.0
"""The longest a training job goes without a line in the log while it commits steps."""


class StepLines:
    """The step lines of one job (see [Note: step lines]); one thread calls ``committed`` at a
    time (the job's lock holder)."""

    def __init__(
        self,
        logger: logging.Logger,
        job_id: str,
        *,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._job_id = job_id
        self._every_s = every_s
        self._clock = clock
        self._last_at: float | None = None
        self._last_step = 0

    def committed(self, step: int, loss: float) -> None:
        """Step ``step`` committed with ``loss``: logs its line at INFO if one is due, else
        at DEBUG."""
        now, last_at, last_step = self._clock(), self._last_at, self._last_step
        due = last_at is None or now - last_at >= self._every_s
        if due:
            self._last_at, self._last_step = now, step
        level = logging.INFO if due else logging.DEBUG
        if not self._logger.isEnabledFor(level):
            return
        rate = ""
        if due and last_at is not None and step > last_step:
            steps, took = step - last_step, now - last_at
            per_s = steps / took if took > 0 else float("inf")
            rate = f" ({steps} steps in {took:.1f} s, {per_s:.2f} steps/s)"
        self._logger.log(
            level,
            "job %s: step %d committed, loss %.6f%s",
            self._job_id,
            step,
            loss,
            rate,
            extra={"job": self._job_id, "step": step},
        )
