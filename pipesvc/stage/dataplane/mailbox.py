"""Tensors arriving from neighbouring stages, held until the schedule asks for them.

[Note: exactly once] Every tensor is keyed by (run, direction, micro-batch). A key is accepted
once: a duplicate is dropped, a key of a finished run is stale and dropped, and a run that was
aborted wakes its waiter with StepAbortedError. So no tensor is ever applied twice.

[Note: the waiter reads the doorbell] Tensors from a neighbour on the same host arrive as
doorbell messages (see [Note: the shared-memory path] in pipesvc.stage.dataplane.shm). No thread of
its own reads a doorbell: a link registers it here as a ``MailSource``, and the thread waiting in
``get`` polls the doorbells itself and delivers what they hold, which saves a thread hand-off
per tensor (a wake-up of the reader, then of the waiter, each a context switch and a fight for
the GIL). While nobody waits, messages stay in the pipe: the schedule takes tensors only in
``get``, and a stage sending into a full doorbell reads its own doorbells while it waits
(``pump``), so two stages filling each other's pipes cannot deadlock. One waiter polls at a time
(the others wait on the condition and take over when it leaves); anything that changes what a
waiter must see (a tensor from a gRPC stream, an abort, a failure, a new or closed doorbell)
writes to an eventfd that the poll also watches, so aborts and dead links still end a wait at
once. A closed source's fd is closed only when no poll uses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from pipesvc.core.limits import MAX_MICROBATCHES
from pipesvc.errors import PipelineTimeoutError, ResourceExhaustedError, StepAbortedError

logger = logging.getLogger(__name__)

ACTIVATION = "activation"
GRADIENT = "gradient"

NORM_PART = 2
"""The part of a run's norm mail (micro-batch 0): the sum of the squared gradient norms on
the gradient link, the total on the activation link (see [Note: norm along the links] in
``pipesvc.core.clipping``)."""

MAX_ITEMS = 3 * MAX_MICROBATCHES + 2
"""What a mailbox holds at most, derived from the largest run a job may ask for.

[Note: mailbox bound] A run of m micro-batches delivers at most one activation and one gradient
per micro-batch, and each is removed when the schedule takes it: at most 2m items of the
current run. The neighbours may start the next run before this stage has finished the
current one (a run is over for the coordinator when every stage answered; an aborted run's
stage may still be winding down), so up to m activations of the next run can arrive early;
its gradients cannot, since they answer this stage's own activations of that run. Mail of a
finished or aborted run is dropped. Hence 3 * MAX_MICROBATCHES, and two for the norm mail of a
job that clips (the current run's sum from downstream, the next run's total from upstream);
more means a peer sends tensors no schedule asked for. A model that carries a vector beside
its activations (see [Note: carried vector] in ``pipesvc.models.carry``) sends two tensors
where others send one, so its stages' mailboxes hold twice as many."""
PARTS = 2
"""Tensors per micro-batch and direction at most: the activation and a carried vector."""


_MAX_POLL_S = 1.0
"""Longest single poll of a waiter (a safety net: every change it must see wakes it at once)."""


class _WakeFd:
    """An eventfd that ends a waiter's poll; closed with its last source (or with this object:
    a mailbox dropped with its links still open)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.close = weakref.finalize(self, os.close, self.fd)

    def ring(self) -> None:
        os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)


class MailSource(Protocol):
    """Something a waiter polls and reads itself: a doorbell (see [Note: the waiter reads
    the doorbell])."""

    def fileno(self) -> int:
        """The fd to poll for reading."""

    def drain(self) -> bool:
        """Delivers (``put``) the tensors it holds now, without waiting; False once it is
        done (end-of-file, closed, or failed: it reported that itself)."""

    def release(self) -> None:
        """Closes the fd (called once, by the mailbox, when no poll uses it)."""


@dataclass(frozen=True, slots=True)
class MailKey:
    """Identity of one tensor on the data plane within a job and plan epoch."""

    run_id: int
    direction: str
    microbatch_index: int
    part: int = 0
    """0: the activation or its gradient; 1: the carried vector or its gradient (see [Note:
    carried vector] in ``pipesvc.models.carry``); ``NORM_PART``: the run's norm mail."""

    def __str__(self) -> str:
        if self.part == NORM_PART:
            what = "norm total" if self.direction == ACTIVATION else "norm sum"
            return f"gradient {what} (run {self.run_id})"
        what = self.direction if self.part == 0 else f"carried {self.direction}"
        return f"{what} of micro-batch {self.microbatch_index} (run {self.run_id})"


class Mailbox:
    """A bounded, thread-safe map from MailKey to tensor with blocking, cancellable gets."""

    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._items: dict[MailKey, torch.Tensor] = {}
        self._consumed: set[MailKey] = set()
        self._finished_below = 0  # runs < this are over; their mail is stale
        self._aborted: set[int] = set()
        self._failure: Exception | None = None
        self._max_items = max_items
        self.num_duplicates = 0
        self.num_stale = 0
        self._sources: list[MailSource] = []
        self._closing: list[MailSource] = []  # removed while a poll used them
        self._poller: int | None = None  # the thread polling the sources, if one is
        self._waker: _WakeFd | None = None  # while there are sources

    def put(self, key: MailKey, tensor: torch.Tensor) -> bool:
        """Stores ``tensor`` under ``key``; returns False if it was stale or a duplicate.

        Raises:
            ResourceExhaustedError: the mailbox holds ``max_items`` tensors already.
        """
        with self._cond:
            if key.run_id < self._finished_below or key.run_id in self._aborted:
                self.num_stale += 1
                logger.warning("dropping stale %s", key)
                return False
            if key in self._items or key in self._consumed:
                self.num_duplicates += 1
                logger.warning("dropping duplicate %s", key)
                return False
            if len(self._items) >= self._max_items:
                raise ResourceExhaustedError(
                    f"mailbox holds {len(self._items)} tensors; the limit is {self._max_items}"
                )
            self._items[key] = tensor
            self._cond.notify_all()
            self._wake()
            return True

    def accepts(self, key: MailKey) -> bool:
        """Whether ``put`` would store ``key`` now: its run is neither over nor aborted, and the
        key is neither held nor taken."""
        with self._cond:
            return not (
                key.run_id < self._finished_below
                or key.run_id in self._aborted
                or key in self._items
                or key in self._consumed
            )

    def get(self, key: MailKey, timeout_s: float, waiting_for: str = "") -> torch.Tensor:
        """Waits for and removes the tensor under ``key``.

        Raises:
            StepAbortedError: the run was aborted while waiting.
            PipelineTimeoutError: nothing arrived within ``timeout_s``.
            Exception: the link feeding this mailbox failed (the failure is re-raised).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._items:
                if key.run_id in self._aborted:
                    raise StepAbortedError(f"run {key.run_id} was aborted")
                if self._failure is not None:
                    raise self._failure
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipelineTimeoutError(
                        f"waited {timeout_s:.1f} s for {key}{waiting_for}; nothing arrived"
                    )
                if self._sources and self._poller is None:
                    self._poll_unlocked(min(remaining, _MAX_POLL_S))
                else:
                    self._cond.wait(remaining)
            self._consumed.add(key)
            return self._items.pop(key)

    def add_source(self, source: MailSource) -> None:
        """Lets waiters read ``source`` (see [Note: the waiter reads the doorbell])."""
        with self._cond:
            if self._waker is None:
                self._waker = _WakeFd()
            self._sources.append(source)
            self._cond.notify_all()  # a waiter on the condition polls it now
            self._wake()

    def remove_source(self, source: MailSource) -> None:
        """Stops reading ``source`` and releases it (now, or once the poll using it is over);
        any thread."""
        with self._cond:
            if source not in self._sources:
                return
            self._sources.remove(source)
            if self._poller is None:
                source.release()
                self._close_waker()
            else:
                self._closing.append(source)
                self._wake()

    def pump(self) -> None:
        """Delivers what the sources hold now without waiting, unless another thread is
        polling them (a sender waiting for room in a doorbell calls this)."""
        with self._cond:
            if self._sources and self._poller is None:
                self._poll_unlocked(0.0)

    def _poll_unlocked(self, timeout_s: float) -> None:
        """Polls the sources for up to ``timeout_s`` without the lock (held on entry and on
        return) and delivers what they hold; this thread is the poller meanwhile."""
        self._poller = threading.get_ident()
        sources = {source.fileno(): source for source in self._sources}
        waker = self._waker
        assert waker is not None  # there are sources
        self._lock.release()
        done = []
        try:
            poller = select.poll()
            poller.register(waker.fd, select.POLLIN)
            for fd in sources:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(timeout_s * 1000):
                if fd == waker.fd:
                    waker.clear()
                elif not sources[fd].drain():
                    done.append(sources[fd])
        finally:
            self._lock.acquire()
            self._poller = None
            for source in done:
                if source in self._sources:
                    self._sources.remove(source)
                    self._closing.append(source)
            for source in self._closing:
                source.release()
            self._closing.clear()
            self._close_waker()
            self._cond.notify_all()  # another waiter may poll now

    def _close_waker(self) -> None:
        """Closes the eventfd once no source is left (the lock is held, no poll runs)."""
        if not self._sources and self._waker is not None:
            self._waker.close()
            self._waker = None

    def _wake(self) -> None:
        """Ends the poll of a waiter on another thread (the lock is held)."""
        if self._poller is not None and self._poller != threading.get_ident():
            assert self._waker is not None  # closed only when no poll runs
            self._waker.ring()

    def fail(self, error: Exception) -> None:
        """Makes current and future waits raise ``error`` (a link broke)."""
        with self._cond:
            self._failure = error
            self._cond.notify_all()
            self._wake()

    def reset_failure(self) -> None:
        """Clears a failure once a new link is in place."""
        with self._cond:
            self._failure = None

    def abort(self, run_id: int) -> None:
        """Wakes waiters of ``run_id`` with StepAbortedError and drops its mail."""
        with self._cond:
            self._aborted.add(run_id)
            self._drop(lambda key: key.run_id == run_id)
            self._cond.notify_all()
            self._wake()

    def is_aborted(self, run_id: int) -> bool:
        """Whether ``run_id`` was aborted (a sender waiting for room checks this)."""
        with self._cond:
            return run_id in self._aborted

    def finish(self, run_id: int) -> None:
        """Marks every run up to ``run_id`` over: their late mail is stale from now on (what
        the doorbells hold already is delivered first, as it would have been by a reader
        thread)."""
        with self._cond:
            if self._sources and self._poller is None:
                self._poll_unlocked(0.0)
            self._finished_below = max(self._finished_below, run_id + 1)
            self._drop(lambda key: key.run_id <= run_id)
            self._consumed = {k for k in self._consumed if k.run_id > run_id}
            self._aborted = {r for r in self._aborted if r > run_id}

    @property
    def num_sources(self) -> int:
        """How many doorbells waiters read now."""
        with self._cond:
            return len(self._sources)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def _drop(self, predicate: object) -> None:
        assert callable(predicate)
        for key in [k for k in self._items if predicate(k)]:
            del self._items[key]
