"""A job's lifecycle between and after its calls: the closed check, maintenance of an idle
job, settling before a description is read, the wait before a coordinator stops, and closing."""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Any

from pipesvc.coordinator.checkpointer import Checkpointer
from pipesvc.coordinator.fair_lock import FairLock
from pipesvc.coordinator.generation import JobGeneration
from pipesvc.coordinator.job_counters import JobState
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.errors import FailedPreconditionError, PipesvcError

logger = logging.getLogger(__name__)

SETTLE_WAIT_S = 1.0
"""How long ``settle`` (GetJob) waits for a call holding the job before it reports without
flushing."""
IDLE_FLUSH_S = 1.0
"""A deferred commit is flushed by maintenance once the job has had no step for this long,
so that stages do not hold a decided step's gradients uncommitted while the client is away."""


class JobLifecycle:
    """The lifecycle part of ``JobDriver``, which provides the job's parts and its lock, and
    runs calls through ``_resilient``."""

    job_id: str
    state: JobState
    group: StageGroup
    ledger: Ledger
    checkpoints: Checkpointer
    generation: JobGeneration
    _lock: FairLock
    _stopping: bool
    _pool: futures.ThreadPoolExecutor

    def _resilient(self, attempt: Any, what: str) -> Any:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self.state.closed:
            raise FailedPreconditionError(f"job {self.job_id} is closed")

    def close(self) -> None:
        """Takes the checkpoint the last step is due, if any, and frees the job's stages (best
        effort on each)."""
        with self._lock:
            if self.state.closed:
                return
            pending = self.ledger.pending
            if pending is not None and pending.snapshot:
                try:
                    self.checkpoints.flush()
                    self.checkpoints.finish(wait=True)
                except PipesvcError as exc:
                    logger.warning("job %s: the last checkpoint failed: %s", self.job_id, exc)
            self.state.closed = True
            for stage in self.group.servers:
                self.group.release(stage)
            self.group.registry.release(self.job_id)
            if self.group.rendezvous is not None:
                self.group.rendezvous.forget(self.job_id)  # see [Note: store keys]
            self.ledger.persist()
            self._pool.shutdown(wait=False)

    def maintain(self) -> None:
        """Between steps: finishes a pending reconcile, moves layers off leaving stages and
        recovers from lost ones, so an idle job is ready and a stopping stage can exit; flushes
        a deferred commit once the job has been idle ``IDLE_FLUSH_S``.

        Does nothing while a step holds the job.
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self.state.closed:
                self._resilient(self._flush_if_idle, "maintenance")
                self._resilient(self.generation.release_orphans, "releasing orphaned sessions")
        except PipesvcError as exc:
            logger.warning("job %s: maintenance failed: %s", self.job_id, exc)
        finally:
            self._lock.release()

    def _flush_if_idle(self) -> None:
        if time.monotonic() - self.ledger.decided_at >= IDLE_FLUSH_S:
            self.checkpoints.flush()

    def settle(self) -> None:
        """Flushes a deferred commit, so that the stages themselves are at ``step`` (for a
        caller that reads the job's description and then looks at its stages), and counts a
        background checkpoint that has reached the disk; a failure is
        recovered from like any call's. Gives up if another call holds the job for longer
        than ``SETTLE_WAIT_S`` (maintenance holds it for a moment; a step's run carries the
        commit anyway, and a description read should not wait out a long step or recovery)."""
        if not self._lock.acquire(timeout=SETTLE_WAIT_S):
            return
        try:
            if not self.state.closed and self.ledger.pending is not None:
                self._resilient(self.checkpoints.flush, "settling the last step")
            if not self.state.closed:
                # A checkpoint written in the background counts once it is on disk, not only
                # when the next step looks (the description reports ``checkpoint_step``).
                self.checkpoints.finish(wait=False)
        finally:
            self._lock.release()

    def wait_idle(self) -> None:
        """Blocks until no step is in flight, then flushes a deferred commit (taking the
        checkpoint its step is due) and lets a background checkpoint finish (best effort: a
        restarted coordinator also finds an unflushed commit, see ``reconcile.reconcile``), for
        a graceful coordinator stop."""
        with self._lock:
            self._stopping = True  # no step starts after this one (a stream's next, say)
            if self.state.closed:
                return
            try:
                self.checkpoints.flush()  # with a checkpoint, if its step is due one
            except PipesvcError as exc:
                logger.warning("job %s: flushing the last commit failed: %s", self.job_id, exc)
            self.checkpoints.finish(wait=True)
