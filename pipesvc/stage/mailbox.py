"""Tensors arriving from neighbouring stages, held until the schedule asks for them.

[Note: exactly once] Every tensor is keyed by (run, direction, micro-batch). A key is accepted
once: a duplicate is dropped, a key of a finished run is stale and dropped, and a run that was
aborted wakes its waiter with StepAbortedError. So no tensor is ever applied twice.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from pipesvc.core.limits import MAX_MICROBATCHES
from pipesvc.errors import PipelineTimeoutError, ResourceExhaustedError, StepAbortedError

logger = logging.getLogger(__name__)

ACTIVATION = "activation"
GRADIENT = "gradient"

MAX_ITEMS = 3 * MAX_MICROBATCHES
"""What a mailbox holds at most, derived from the largest run a job may ask for.

[Note: mailbox bound] A run of m micro-batches delivers at most one activation and one gradient
per micro-batch, and each is removed when the schedule takes it: at most 2m items of the
current run. The neighbours may start the next run before this stage has finished the
current one (a run is over for the coordinator when every stage answered; an aborted run's
stage may still be winding down), so up to m activations of the next run can arrive early;
its gradients cannot, since they answer this stage's own activations of that run. Mail of a
finished or aborted run is dropped. Hence 3 * MAX_MICROBATCHES; more means a peer sends
tensors no schedule asked for. A model that carries a vector beside its activations (see [Note:
carried vector] in ``pipesvc.models.carry``) sends two tensors where others send one, so its
stages' mailboxes hold twice as many."""
PARTS = 2
"""Tensors per micro-batch and direction at most: the activation and a carried vector."""


@dataclass(frozen=True, slots=True)
class MailKey:
    """Identity of one tensor on the data plane within a job and plan epoch."""

    run_id: int
    direction: str
    microbatch_index: int
    part: int = 0
    """0: the activation or its gradient; 1: the carried vector or its gradient (see [Note:
    carried vector] in ``pipesvc.models.carry``)."""

    def __str__(self) -> str:
        what = self.direction if self.part == 0 else f"carried {self.direction}"
        return f"{what} of micro-batch {self.microbatch_index} (run {self.run_id})"


class Mailbox:
    """A bounded, thread-safe map from MailKey to tensor with blocking, cancellable gets."""

    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self._cond = threading.Condition()
        self._items: dict[MailKey, torch.Tensor] = {}
        self._consumed: set[MailKey] = set()
        self._finished_below = 0  # runs < this are over; their mail is stale
        self._aborted: set[int] = set()
        self._failure: Exception | None = None
        self._max_items = max_items
        self.num_duplicates = 0
        self.num_stale = 0

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
            return True

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
                self._cond.wait(remaining)
            self._consumed.add(key)
            return self._items.pop(key)

    def fail(self, error: Exception) -> None:
        """Makes current and future waits raise ``error`` (a link broke)."""
        with self._cond:
            self._failure = error
            self._cond.notify_all()

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

    def is_aborted(self, run_id: int) -> bool:
        """Whether ``run_id`` was aborted (a sender waiting for room checks this)."""
        with self._cond:
            return run_id in self._aborted

    def finish(self, run_id: int) -> None:
        """Marks every run up to ``run_id`` over: their late mail is stale from now on."""
        with self._cond:
            self._finished_below = max(self._finished_below, run_id + 1)
            self._drop(lambda key: key.run_id <= run_id)
            self._consumed = {k for k in self._consumed if k.run_id > run_id}
            self._aborted = {r for r in self._aborted if r > run_id}

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def _drop(self, predicate: object) -> None:
        assert callable(predicate)
        for key in [k for k in self._items if predicate(k)]:
            del self._items[key]
