"""A lock that callers get in the order they asked for it (no gRPC here).

A job's calls (training steps, generation steps, reads of its state) take turns on the job's
lock. ``threading.Lock`` lets the thread that just released it take it again before a waiting
one wakes, so a loop of training steps could hold a generation session off for many steps;
this lock hands it to the longest waiter, so no call waits for more than the calls queued
before it.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType


class FairLock:
    """A first-come, first-served mutual exclusion lock (not reentrant)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0
        self._held = False
        self._abandoned: set[int] = set()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Takes the lock in turn; False if not ``blocking`` and it is taken, or after
        ``timeout`` seconds (a negative timeout waits for ever)."""
        with self._cond:
            if not blocking:
                if self._held or self._serving != self._next_ticket:
                    return False
                self._next_ticket += 1
                self._held = True
                return True
            ticket = self._next_ticket
            self._next_ticket += 1
            deadline = None if timeout < 0 else time.monotonic() + timeout
            while self._held or self._serving != ticket:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._give_up(ticket)
                    return False
                self._cond.wait(left)
            self._held = True
            return True

    def contended(self) -> bool:
        """Whether some call waits for the lock (asked by its holder)."""
        with self._cond:
            return self._next_ticket - self._serving - len(self._abandoned) > 1

    def _give_up(self, ticket: int) -> None:
        """A waiter that times out leaves the queue: later tickets move up by one."""
        self._abandoned.add(ticket)
        self._skip_abandoned()
        self._cond.notify_all()

    def _skip_abandoned(self) -> None:
        while self._serving in self._abandoned and not self._held:
            self._abandoned.discard(self._serving)
            self._serving += 1

    def release(self) -> None:
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an unheld FairLock")
            self._held = False
            self._serving += 1
            self._skip_abandoned()
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
