"""A stage's generation sessions: the key/value caches of its own layers, per session and part.

[Note: generation sessions] A generation session (``Job.generate``) keeps, on every stage, the
keys and values its layers computed for the tokens so far, so each new token is one pass of one
position through the pipeline. The coordinator splits a session's rows into parts (micro-batches,
fixed for the session's life) and names each part's cache in the run request (``CacheRef``):
``fresh`` starts it empty (the prompt's prefill, or a replay of every token so far after a
stage was lost), otherwise the part must already have one here. The caches of a stage are
bounded by its KV budget: a run that leaves them above it releases the caches of the sessions
it touched and fails with RESOURCE_EXHAUSTED, naming the sizes. A session idle longer than the
idle timeout is dropped; so is one whose run failed midway (its parts may disagree), and one the
coordinator releases (the client finished or went away). A new assignment (a new plan epoch)
starts with no caches: the coordinator replays the session's tokens to rebuild them.
No gRPC here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pipesvc.core.microbatch import CacheRef
from pipesvc.errors import FailedPreconditionError, ResourceExhaustedError

logger = logging.getLogger(__name__)

MIB = 2**20


def cache_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors a cache holds (its own ``nbytes()``, or a
    ``transformers`` cache's layers)."""
    own = getattr(cache, "nbytes", None)
    if callable(own):
        return int(own())
    tensors: list[Any] = []
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    else:  # older transformers: one list per kind
        tensors += list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", []))
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class SessionCaches:
    """The caches of one job's sessions on one stage (see [Note: generation sessions])."""

    def __init__(
        self,
        new_cache: Callable[[], Any] | None,
        *,
        budget_bytes: int,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._new_cache = new_cache
        self._budget = budget_bytes
        self._idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._caches: dict[tuple[str, int], Any] = {}
        self._used: dict[str, float] = {}
        self._cohort: Any = None
        self._cohort_sessions: frozenset[str] = frozenset()

    def get(self, ref: CacheRef) -> Any:
        """The cache of ``ref`` (an empty one when ``ref.fresh``).

        Raises:
            FailedPreconditionError: the model has no cache, or the part has none here (never
                started, expired or released).
        """
        if self._new_cache is None:
            raise FailedPreconditionError("this model has no key/value cache to generate with")
        key = (ref.session, ref.part)
        with self._lock:
            if ref.fresh:
                self._caches[key] = self._new_cache()
            elif key not in self._caches:
                raise FailedPreconditionError(
                    f"session {ref.session!r} part {ref.part} has no cache on this stage "
                    "(expired, released or never started); start it again"
                )
            self._used[ref.session] = self._clock()
            return self._caches[key]

    def put(self, ref: CacheRef, cache: Any) -> None:
        """Replaces the cache of ``ref``'s part (after a fused run cut it back, see [Note:
        fused decode] in ``pipesvc.stage.fused_cache``)."""
        with self._lock:
            self._caches[(ref.session, ref.part)] = cache
            self._used[ref.session] = self._clock()

    def session_bytes(self, session: str) -> int:
        with self._lock:
            caches = [c for (s, _), c in self._caches.items() if s == session]
        return sum(cache_bytes(c) for c in caches)

    def total_bytes(self) -> int:
        with self._lock:
            caches = list(self._caches.values())
        return sum(cache_bytes(c) for c in caches)

    def sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._used)

    def settle(self, sessions: Iterable[str]) -> None:
        """After a run that extended ``sessions``: enforces the budget.

        Raises:
            ResourceExhaustedError: the caches exceed the budget; ``sessions`` were released.
        """
        total = self.total_bytes()
        if total <= self._budget:
            return
        touched = sorted(set(sessions))
        sizes = {s: self.session_bytes(s) for s in touched}
        for session in touched:
            self.release(session)
        raise ResourceExhaustedError(
            f"key/value caches would hold {total / MIB:.2f} MiB on this stage, over its budget "
            f"of {self._budget / MIB:.2f} MiB (--kv-budget); released session(s) "
            + ", ".join(f"{s!r} ({b / MIB:.2f} MiB)" for s, b in sizes.items())
            + f"; {len(self.sessions())} other session(s) hold {self.total_bytes() / MIB:.2f} MiB"
        )

    @property
    def cohort(self) -> Any:
        """What the last fused run left to reuse (see [Note: fused decode] in
        ``pipesvc.stage.fused_cache``), or None; dropped with any of its sessions."""
        with self._lock:
            return self._cohort

    def keep_cohort(self, cohort: Any, sessions: Iterable[str]) -> None:
        with self._lock:
            self._cohort = cohort
            self._cohort_sessions = frozenset(sessions)

    def release(self, session: str) -> int:
        """Drops every part of ``session``; returns the bytes freed (0 if it had none)."""
        with self._lock:
            keys = [k for k in self._caches if k[0] == session]
            dropped = [self._caches.pop(k) for k in keys]
            self._used.pop(session, None)
            if session in self._cohort_sessions:
                self._cohort, self._cohort_sessions = None, frozenset()
        return sum(cache_bytes(c) for c in dropped)

    def expire(self) -> list[str]:
        """Drops the sessions idle for longer than the idle timeout; returns them."""
        now = self._clock()
        with self._lock:
            idle = [s for s, used in self._used.items() if now - used > self._idle_s]
        for session in idle:
            freed = self.release(session)
            logger.info(
                "session %s expired after %.0f s idle (%.2f MiB freed)",
                session,
                self._idle_s,
                freed / MIB,
            )
        return idle

    def clear(self) -> None:
        with self._lock:
            self._caches.clear()
            self._used.clear()
            self._cohort, self._cohort_sessions = None, frozenset()
