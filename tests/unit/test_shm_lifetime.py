"""[Note: shared-memory lifetime]: no teardown order unmaps memory or closes an fd under a user.

The races run in a child process, so a SIGSEGV fails the test instead of killing pytest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

from pipesvc.stage.dataplane import shm
from pipesvc.stage.dataplane.shm import HEADER_BYTES, ShmArea, ShmView

_ROOT = str(Path(__file__).resolve().parents[2])


def _run_child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _ROOT}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def _area(limit: int = 4 << 20) -> ShmArea:
    area = ShmArea.create(limit)
    assert area is not None, "/dev/shm is needed for these tests"
    return area


def test_received_tensor_outlives_its_closed_link() -> None:
    """A tensor over a slot (an activation saved for backward) stays mapped and exact after
    both the view and the area are closed, and the mapping goes with the tensor."""
    child = _run_child(
        """
        import gc, torch
        from pipesvc.stage.dataplane import shm

        def mapped(name):
            with open("/proc/self/maps") as maps:
                return name in maps.read()

        area = shm.ShmArea.create(4 << 20)
        view = shm.ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
        sent = torch.arange(300_000, dtype=torch.float32)
        slot = area.write(sent)
        held = view.take(slot.seq, slot.offset, sent.numel() * 4).view(torch.float32)
        area.close()
        view.close()
        del area, view
        gc.collect()
        assert mapped("pipesvc-"), "unmapped too early"
        assert torch.equal(held, sent), "the bytes changed under the tensor"
        held.add_(1)  # still writable memory, not a dangling page
        del held
        gc.collect()
        assert not mapped("pipesvc-"), "the mapping outlived its last tensor"
        print("ok")
        """
    )
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-2000:]


def test_closing_an_area_while_a_thread_writes_into_it() -> None:
    """The sender's stream teardown (another thread) closes the area while the compute thread
    copies a multi-MiB tensor into it: before, the copy hit unmapped memory (SIGSEGV)."""
    child = _run_child(
        """
        import threading, torch
        from pipesvc.stage.dataplane import shm

        big = torch.randn(4 << 20)  # 16 MiB
        for _ in range(30):
            area = shm.ShmArea.create(64 << 20)
            slots = []
            fill = lambda: slots.extend(area.write(big) for _ in range(4))
            writer = threading.Thread(target=fill)
            writer.start()
            area.close()
            writer.join()
            after = area.write(big)
            assert after is None, "a closed area took a write"
        print("ok")
        """
    )
    assert child.returncode == 0 and child.stdout.strip() == "ok", (
        child.returncode,
        child.stderr[-2000:],
    )


def test_closing_the_doorbell_while_a_thread_rings() -> None:
    """ring() racing close(): every ring either delivers or raises OSError; none writes to a
    closed (possibly reused) fd number."""
    child = _run_child(
        """
        import os, threading
        from pipesvc.stage.dataplane import shm

        for _ in range(200):
            area = shm.ShmArea.create(1 << 20)
            view = shm.ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
            assert area.open_bell()
            errors = []

            def ring():
                try:
                    for _ in range(50):
                        area.ring(b"x" * 100)
                except OSError as exc:
                    errors.append(exc)

            ringer = threading.Thread(target=ring)
            ringer.start()
            area.close()
            # A pipe made now may take the closed bell's number: nothing may land in it.
            r, w = os.pipe()
            ringer.join()
            os.set_blocking(r, False)
            try:
                leaked = os.read(r, 1)
            except BlockingIOError:
                leaked = b""
            assert leaked == b"", "a ring wrote to a reused fd"
            os.close(r)
            os.close(w)
            view.close()
            view.close_bell()
        print("ok")
        """
    )
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-2000:]


def test_a_full_doorbell_wait_ends_on_cancel_and_on_close() -> None:
    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    try:
        assert area.open_bell()
        while area.ring(b"x" * 1000, cancelled=lambda: True):
            pass  # fills the pipe; the first ring that would wait is cancelled instead
        assert not area.ring(b"x" * 1000, cancelled=lambda: True)
        failed: list[OSError] = []

        def ring() -> None:
            try:
                area.ring(b"x" * 1000)
            except OSError as exc:
                failed.append(exc)

        ringer = threading.Thread(target=ring)
        ringer.start()
        area.close()
        ringer.join(timeout=30)
        assert not ringer.is_alive() and len(failed) == 1
    finally:
        view.close_bell()
        view.close()
        area.close()


def test_closing_a_view_wakes_its_doorbell_reader() -> None:
    """A stopped sender keeps its end of the doorbell open; closing the link must still end
    the receiver's doorbell thread (one leaked thread per recovery otherwise)."""
    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    assert area.open_bell()  # a writer that never writes
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(view.read_bell()))
    reader.start()
    view.close()
    reader.join(timeout=30)
    assert not reader.is_alive() and got == [None]
    view.close_bell()
    area.close()


def test_stale_area_of_a_killed_sender_is_removed(tmp_path: Path) -> None:
    """A sender SIGKILLed between offer and answer leaves its area and doorbell in /dev/shm;
    the next area created on the host removes them (its creator's pid is in the name)."""
    with subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, signal; from pipesvc.stage.dataplane import shm; "
            "a = shm.ShmArea.create(1 << 20); "
            "print(a.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)",
        ],
        env={**os.environ, "PYTHONPATH": _ROOT},
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        path = child.stdout.readline().strip()
        assert child.wait(timeout=60) == -signal.SIGKILL
    leftovers = [path, path + shm.BELL_SUFFIX]
    assert all(os.path.exists(p) for p in leftovers), leftovers
    old = time.time() - 2 * shm.STALE_AFTER_S
    for p in leftovers:
        os.utime(p, (old, old))
    _area().close()
    assert not any(os.path.exists(p) for p in leftovers), leftovers


def test_a_fresh_area_of_a_live_process_is_kept() -> None:
    area = _area()
    try:
        os.utime(area.path, (0, 0))  # old, but its creator (this process) lives
        assert area.name not in shm.remove_stale_areas(min_age_s=0)
        assert os.path.exists(area.path)
    finally:
        area.close()


def test_pages_of_freed_slots_go_back_to_the_system() -> None:
    area = _area(8 << 20)
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    try:
        big = torch.ones(1 << 20)  # 4 MiB
        slot = area.write(big)
        assert slot is not None
        held = view.take(slot.seq, slot.offset, 4 << 20)
        used = os.stat(area.path).st_blocks * 512
        assert used >= 4 << 20, used
        del held  # the slot is free; the next write gives its pages back
        small = area.write(torch.ones(4))
        assert small is not None and small.offset == HEADER_BYTES
        after = os.stat(area.path).st_blocks * 512
        assert after <= 2 * HEADER_BYTES, (used, after)
        assert area.reserved_bytes <= 2 * HEADER_BYTES
    finally:
        view.close()
        area.close()


def test_stale_area_of_a_reused_pid_is_removed(tmp_path: Path) -> None:
    """A pid alone is reused (pid 1 of every restarted container): an area named with a live
    pid but another start time is a dead process's and goes. (In a directory of its own: a
    stage of another test creating an area would sweep /dev/shm first.)"""
    path = tmp_path / (f"pipesvc-{os.getpid()}-1-" + "e" * 32)
    path.touch()
    os.utime(path, (0, 0))
    assert shm.remove_stale_areas(str(tmp_path)) == [path.name]
    assert not path.exists()
