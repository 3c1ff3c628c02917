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
        now = self._clock()
        due = self._last_at is None or now - self._last_at >= self._every_s
        extra = {"job": self._job_id, "step": step}
        if not due:
            self._logger.debug(
                "job %s: step %d committed, loss %.6f", self._job_id, step, loss, extra=extra
            )
            return
        if self._last_at is None or step <= self._last_step:
            self._logger.info(
                "job %s: step %d committed, loss %.6f", self._job_id, step, loss, extra=extra
            )
        else:
            steps, took = step - self._last_step, now - self._last_at
            self._logger.info(
                "job %s: step %d committed, loss %.6f (%d steps in %.1f s, %.2f steps/s)",
                self._job_id,
                step,
                loss,
                steps,
                took,
                steps / took if took > 0 else float("inf"),
                extra=extra,
            )
        self._last_at, self._last_step = now, step
