"""The files behind shared-memory areas: their names, the removal of stale ones, file
descriptors shared between threads, their mappings, and reading the doorbell FIFO (no gRPC
here).

See [Note: the shared-memory path] and [Note: shared-memory lifetime] in
pipesvc.stage.dataplane.shm.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import select
import stat
import threading
import time
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
AREA_NAME = re.compile(r"pipesvc-([0-9]+)-([0-9]+)-[0-9a-f]{32}")
"""pipesvc-<creator's pid>-<its start time in clock ticks>-<random>: the pair names a process
uniquely on a host (a pid alone is reused, e.g. pid 1 of every restarted container)."""
STALE_AFTER_S = 30.0
"""An area file this old whose creator is gone is stale (the file normally lives only between
offer and answer, well under a second)."""
BELL_SUFFIX = ".bell"
"""The doorbell FIFO's name is its area's name plus this."""
CONSUMED_OFFSET = 64
"""Where in an area's header the receiver publishes the highest slot freed in order."""
POLL_S = 0.1
"""How often a wait on the doorbell checks whether its side was closed or cancelled."""


def _start_ticks(pid: int) -> int:
    """When process ``pid`` started (clock ticks after boot); -1 when no such process is seen
    here (/proc/<pid>/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return int(stat_file.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


def process_id() -> str:
    """This process's part of an area name (computed each time: a fork is another process)."""
    pid = os.getpid()
    return f"{pid}-{_start_ticks(pid)}"


def remove_stale_areas(directory: str = SHM_DIR, min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Removes area files (and doorbells) whose creating process is gone, older than
    ``min_age_s``: what a sender killed between offer and answer leaves behind. Returns the
    names removed. (A process of another pid namespace sharing ``/dev/shm`` may look dead
    here; the age keeps its fresh offers safe, and an old one removed is refused and sent as
    frames.)"""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in names:
        match = AREA_NAME.fullmatch(name.removesuffix(BELL_SUFFIX))
        if match is None or _start_ticks(int(match.group(1))) == int(match.group(2)):
            continue  # not an area, or its creator lives
        path = os.path.join(directory, name)
        try:
            if now - os.lstat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
        except OSError:
            continue  # gone already, or not ours to remove
        removed.append(name)
    if removed:
        logger.info("removed %d stale shared-memory files: %s", len(removed), removed)
    return removed


class SharedFd:
    """A file descriptor closed only when no call uses it any more (see [Note: shared-memory
    lifetime]): ``close`` marks it closed, and the last user closes the number."""

    def __init__(self, fd: int, what: str) -> None:
        self._fd = fd
        self._what = what
        self._users = 0
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        """The fd, open for the duration of the block.

        Raises:
            OSError: EBADF, it was closed.
        """
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, f"{self._what} is closed")
            self._users += 1
        try:
            yield self._fd
        finally:
            with self._lock:
                self._users -= 1
                last = self._closed and self._users == 0
            if last:
                os.close(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = self._users == 0
        if last:
            os.close(self._fd)


def open_bell_reader(path: str) -> int:
    """Opens a doorbell FIFO for reading (non-blocking) without waiting for a writer.

    Raises:
        OSError: missing, or not a FIFO.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a FIFO")
    return fd


def read_some(fd: int, n: int, poller: select.poll, closed: Callable[[], bool]) -> bytes | None:
    """Up to ``n`` bytes from the non-blocking FIFO ``fd``, as many as are there once some are;
    None at end-of-file, or once ``closed()``. It waits in ``poll`` before reading: on Linux a
    FIFO reports hang-up only after a writer has come and gone, while ``read`` returns
    end-of-file whenever no writer is there, also before the first one has opened it."""
    while True:
        if not poller.poll(POLL_S * 1000):
            if closed():
                return None
            continue
        try:
            chunk = os.read(fd, n)
        except BlockingIOError:
            continue
        return chunk or None


class Mapping:
    """A mapped area file and a byte tensor over it.

    ``close`` drops this object's references only: the mmap is unmapped when the last tensor
    or array over it is gone (see [Note: shared-memory lifetime])."""

    def __init__(self, fd: int, size: int) -> None:
        mapped = mmap.mmap(fd, size)
        self.mmap: mmap.mmap | None = mapped
        self.bytes: torch.Tensor | None = torch.frombuffer(mapped, dtype=torch.uint8)
        self.consumed = self.bytes[CONSUMED_OFFSET : CONSUMED_OFFSET + 8].view(torch.int64)
        self.size = size

    def close(self) -> None:
        # Never mmap.close(): torch.frombuffer does not pin the buffer, so an explicit close
        # would unmap under a copy in flight or a tensor over a slot.
        self.mmap = None
        self.bytes = None
        self.consumed = torch.zeros(1, dtype=torch.int64)
