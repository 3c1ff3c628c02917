"""When a training job takes its periodic checkpoints.

[Note: checkpoint cadence]
A checkpoint costs about the same whatever the step: its bytes stream from the stages to the
coordinator and are written and synced, beside the training that goes on meanwhile (see
[Note: snapshot checkpoint] in stage/compute/engine.py). Every N steps is a fine rule when the steps
are long and the state is small; with short steps and a large state it costs a fifth of the
training time on a host whose cores the stages already keep busy. So, as CheckFreq (Mohan et
al., FAST '21) does, the default cadence is set by cost, not by a step count:

- the first checkpoint comes ``AUTO_MIN_STEPS`` steps after the job starts;
- after each one, the interval becomes the fewest steps whose training time is at least
  ``1 / AUTO_OVERHEAD`` times what that checkpoint took, from the first step of its stream to
  durable on disk (wall time, an upper bound on what it took from the steps beside it), so the
  checkpoints take at most ``AUTO_OVERHEAD`` of the training time;
- never fewer than ``AUTO_MIN_STEPS`` steps apart, and never more than ``AUTO_MAX_INTERVAL_S``
  of training apart, so recovery never replays more than about that much.

A job that names ``checkpoint_every`` gets exactly that: a checkpoint at every step that is a
multiple of it. With 0 there is no periodic checkpoint: recovery restores the job's start (its
seed's weights, or the state it was resumed from or last loaded, which is checkpointed) and
replays every step logged since. Left at that, the step log and a recovery's replay would grow
without bound; so once the log holds more bytes than ``log_bound`` allows (as many as a
checkpoint of the job takes, and at least ``LOG_BOUND_MIN_BYTES``), a checkpoint is taken anyway
and the log behind it pruned: writing it costs no more than writing the log did.
"""

from __future__ import annotations

import math

AUTO_MIN_STEPS = 10
"""The fewest steps between two checkpoints under the cost-set cadence (and the first one)."""
AUTO_OVERHEAD = 0.02
"""The share of training time the cost-set cadence lets checkpoints take."""
AUTO_MAX_INTERVAL_S = 1800.0
"""The most training time between two checkpoints under the cost-set cadence."""
LOG_BOUND_MIN_BYTES = 64 << 20
"""With ``checkpoint_every=0``, the step log may hold at least this much before a checkpoint
is taken to prune it (a small job's log stays checkpoint-free for thousands of steps)."""
_STEP_WEIGHT = 0.2
"""Weight of the newest step in the running mean of step times."""


class CheckpointCadence:
    """Decides which committed steps get a periodic checkpoint (see [Note: checkpoint
    cadence]); ``every`` None is the cost-set cadence, an int the fixed one."""

    def __init__(self, every: int | None, *, start_step: int = 0) -> None:
        self.every = every
        self.interval = AUTO_MIN_STEPS
        """Steps between checkpoints under the cost-set cadence, as the last one set it."""
        self.step_s: float | None = None
        """Running mean of the seconds a training step takes."""
        self._last = start_step  # the newest step with a checkpoint taken or asked for

    def step_took(self, seconds: float) -> None:
        """A training step took ``seconds`` (its wall time, as the caller saw it)."""
        if self.step_s is None:
            self.step_s = seconds
        else:
            self.step_s += _STEP_WEIGHT * (seconds - self.step_s)

    def due(self, step: int) -> bool:
        """Whether committed step ``step`` should get a periodic checkpoint."""
        if self.every is not None:
            return self.every > 0 and step % self.every == 0
        return step - self._last >= self.interval

    def asked(self, step: int) -> None:
        """A checkpoint of ``step`` was asked for: the next one counts from it."""
        self._last = max(self._last, step)

    def restart(self, step: int) -> None:
        """The job's state was loaded at ``step`` (maybe older): the next one counts from it."""
        self._last = step

    def checkpointed(self, step: int, seconds: float) -> None:
        """A checkpoint of ``step`` became durable ``seconds`` after it started."""
        self._last = max(self._last, step)
        if self.step_s is None or self.step_s <= 0:
            return
        steps = math.ceil(seconds / (AUTO_OVERHEAD * self.step_s) - 1e-9)
        longest = max(AUTO_MIN_STEPS, math.floor(AUTO_MAX_INTERVAL_S / self.step_s))
        self.interval = min(max(AUTO_MIN_STEPS, steps), longest)


def log_bound(checkpoint_bytes: int) -> int:
    """How many bytes the step log of a ``checkpoint_every=0`` job may hold before a checkpoint
    is taken to prune it (see [Note: checkpoint cadence]): a checkpoint's size, at least
    ``LOG_BOUND_MIN_BYTES``."""
    return max(checkpoint_bytes, LOG_BOUND_MIN_BYTES)
