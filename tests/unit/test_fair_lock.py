"""The job lock hands itself to the longest waiter (``pipesvc.coordinator.fair_lock``)."""

from __future__ import annotations

import threading
import time

from pipesvc.coordinator.fair_lock import FairLock


def test_waiters_get_the_lock_in_the_order_they_asked() -> None:
    lock = FairLock()
    order: list[int] = []
    lock.acquire()
    threads = []
    for i in range(6):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()))
        t.start()
        threads.append(t)
        time.sleep(0.02)  # each asks after the one before
    lock.release()
    for t in threads:
        t.join(timeout=5)
    assert order == list(range(6))


def test_a_thread_that_releases_cannot_jump_the_queue() -> None:
    # threading.Lock lets the releasing thread take it straight back (it still runs); a
    # training loop could hold a generation session off that way for many steps.
    lock = FairLock()
    order: list[str] = []
    lock.acquire()
    waiter = threading.Thread(
        target=lambda: (lock.acquire(), order.append("waiter"), lock.release())
    )
    waiter.start()
    time.sleep(0.1)  # the waiter is queued
    for _ in range(3):
        lock.release()
        lock.acquire()  # back at once: after the waiter
        order.append("holder")
    lock.release()
    waiter.join(timeout=5)
    assert order == ["waiter", "holder", "holder", "holder"]


def test_timeouts_and_non_blocking_attempts_leave_the_queue_working() -> None:
    lock = FairLock()
    assert lock.acquire(blocking=False)
    assert not lock.acquire(blocking=False)
    started = time.monotonic()
    assert not lock.acquire(timeout=0.05)  # gives up and leaves the queue
    assert time.monotonic() - started >= 0.05
    got = threading.Event()
    t = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()))
    t.start()
    time.sleep(0.02)
    lock.release()
    t.join(timeout=5)
    assert got.is_set()  # the abandoned turn did not block the next waiter
    assert lock.acquire(timeout=1)
    lock.release()


def test_its_holder_sees_whether_anyone_waits() -> None:
    lock = FairLock()
    lock.acquire()
    assert not lock.contended()
    waiter = threading.Thread(target=lambda: (lock.acquire(), lock.release()))
    waiter.start()
    deadline = time.monotonic() + 5
    while not lock.contended() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lock.contended()
    lock.release()
    waiter.join(timeout=5)
    assert lock.acquire(timeout=1)
    assert not lock.contended()
    assert not lock.acquire(timeout=0.05)  # a waiter that gave up is not counted
    assert not lock.contended()
    lock.release()
