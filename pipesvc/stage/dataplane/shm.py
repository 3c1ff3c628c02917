"""Shared-memory payloads between two stages on one host (no gRPC here).

[Note: the shared-memory path] A sender creates one area, a file under ``/dev/shm``, and offers
its name and a random nonce on the stream. A receiver that can open the file and finds the nonce
at its start shares the sender's host and ``/dev/shm``; it maps the area and accepts, and from
then on a payload is one ``memcpy`` into the area by the sender, and the receiver's tensor is the
area's memory itself, while the stream carries neither. A receiver that cannot open it
(another host, another container) refuses, and the stream keeps carrying frames. After the answer
the sender unlinks the file: both ends keep their mappings. An area's name carries its
creator's pid, so an area offered by a sender killed before the answer is found and removed
when a later area is created (``remove_stale_areas``).

The area holds slots, one per tensor, numbered in sending order. A received tensor is handed to
the stage as its slot's memory itself (``ShmView.take``: no copy), and the slot is freed when the
stage drops the tensor, e.g. an activation after its backward; slots freed out of order are
published in order: the receiver stores in the area's header the highest ``n`` such that slot
``n`` and every earlier one are free. The sender places each slot at the lowest offset that
overlaps no live slot, so a link touches (and keeps resident) only as many pages as it has in
flight. When there is no room, or a payload is larger than the area, ``ShmArea.write`` returns
None and the caller sends frames: a sender never waits for room, since the receiver may hold
its slots until a backward that needs the very tensor being sent.

Beside the area the sender makes a FIFO (the area's name plus ``.bell``), the *doorbell*: once
the offer is accepted, a tensor's header and slot (a few hundred bytes) are written to it by the
sending thread itself, and the receiver's thread waiting for that tensor (polling the doorbell
itself, see [Note: the waiter reads the doorbell] in pipesvc.stage.dataplane.mailbox) reads and
delivers it.
The stream stays the control path (offer, answer, fallback frames) and the liveness signal;
the doorbell takes gRPC's per-message cost (queues, its threads and completion queues on both
sides) off every activation and gradient, which is what small micro-batches are bound by. A
message is one ``write`` of at most ``PIPE_BUF`` bytes, so it is atomic; the writer blocks while
the pipe is full, and the reader sees end-of-file when the writer closes or dies.

[Note: shared-memory lifetime] Mapped memory and file descriptors live until their last user
is done, so that no teardown order (a stream's end on a gRPC thread, a plan change, a dead
neighbour) can unmap memory or close an fd under a thread still using it. The ``mmap`` is never
closed explicitly: closing an area or a view only drops its own references, and the mapping
goes with the last Python object over it; every tensor over it holds one (``torch.frombuffer``
references the mmap, ``numpy.frombuffer`` exports it, and a copy in flight holds the byte
tensor in a local). The area's fd and the doorbell's fd are ``SharedFd``
(pipesvc.stage.dataplane.shm_files): a call uses the fd under a count, closing only marks it closed,
and the last user closes the number, so a write never lands on a reused fd number. The doorbell's
reading end is closed by the mailbox polling it, once no poll uses it (``Mailbox.remove_source``).
Waits on the doorbell poll with a short timeout and end when their side is closed (or the caller
cancels), so closing wakes every waiter.

Pages of a tmpfs file are allocated on first touch; writing to one when ``/dev/shm`` is full
raises SIGBUS. The sender therefore reserves pages with ``posix_fallocate`` before it first
writes past its high-water mark, which fails with an ordinary error instead. Pages above the
highest live slot go back to the system (``madvise(MADV_REMOVE)`` frees tmpfs pages) when the
sender next places a slot and its use has more than halved, so a link keeps resident about
what it has in flight.

Trust: a peer that has passed authentication and runs on the same host as the receiver could
shrink its file under the receiver's mapping and crash it (SIGBUS on a read), or change a
tensor it already sent; such a peer could equally signal the process. Names, offsets and sizes
from the stream are checked. The published counter is a plain aligned 8-byte store, read by the
sender after the receiver is done with the slot; x86-64 keeps that order, and the Python and
torch calls between the two are full barriers in practice elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import select
import stat
import struct
import threading
import weakref
from collections.abc import Callable

import numpy
import torch

from pipesvc.errors import WireFormatError
from pipesvc.stage.dataplane.shm_files import (
    AREA_NAME,
    BELL_SUFFIX,
    POLL_S,
    SHM_DIR,
    STALE_AFTER_S,
    Mapping,
    SharedFd,
    open_bell_reader,
    process_id,
    read_some,
    remove_stale_areas,
)
from pipesvc.stage.dataplane.slot_allocator import ALIGN, Slot, SlotAllocator

__all__ = [
    "ALIGN",
    "BELL_SUFFIX",
    "DEFAULT_AREA_BYTES",
    "HEADER_BYTES",
    "MAX_AREA_BYTES",
    "MAX_BELL_MESSAGE",
    "MIN_AREA_BYTES",
    "SHM_DIR",
    "STALE_AFTER_S",
    "ShmArea",
    "ShmView",
    "Slot",
    "SlotAllocator",
    "remove_stale_areas",
]

logger = logging.getLogger(__name__)

DEFAULT_AREA_BYTES = 256 << 20
"""Largest area a sender creates (sparse: only touched pages use memory)."""
MIN_AREA_BYTES = 1 << 20
"""Below this (e.g. a nearly full ``/dev/shm``) no area is offered."""
MAX_AREA_BYTES = 1 << 40
"""Largest offered area a receiver maps (mapping reserves address space, not memory)."""
HEADER_BYTES = 4096
"""The nonce and the receiver's consumed counter live here; slots start after it."""
_NONCE_BYTES = 16
_TRIM_MIN_BYTES = 1 << 20
"""Freed pages above the live slots are given back once there are more than this many."""
_LENGTH_BYTES = 4
MAX_BELL_MESSAGE = 4096 - _LENGTH_BYTES
"""Largest doorbell message body (a message and its length prefix are one atomic write)."""
_LENGTH = struct.Struct("<I")
_BELL_READ_BYTES = 1 << 16
"""Most doorbell bytes one read takes (a pipe's default capacity)."""


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _area_size(limit: int) -> int:
    try:
        fs = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    free = fs.f_bavail * fs.f_frsize
    return min(limit, free // 4) // mmap.PAGESIZE * mmap.PAGESIZE


def _page_up(n: int) -> int:
    return (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class ShmArea:
    """The sender's area: it writes payloads in; the receiver's tensors are its slots.

    One thread writes and rings; any thread may close (see [Note: shared-memory lifetime])."""

    def __init__(self, fd: int, path: str, size: int) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self._map = Mapping(fd, size)
        self._fd = SharedFd(fd, f"shared-memory area {self.name}")
        assert self._map.bytes is not None
        self._map.bytes[:_NONCE_BYTES].copy_(
            torch.frombuffer(bytearray(self.nonce), dtype=torch.uint8)
        )
        self._ring = SlotAllocator(size - HEADER_BYTES)
        self._reserved = HEADER_BYTES
        self._unlinked = False
        self._bell: SharedFd | None = None
        self._closed = False
        self._bell_lock = threading.Lock()  # open_bell (reading thread) against close

    @classmethod
    def create(cls, limit: int = DEFAULT_AREA_BYTES) -> ShmArea | None:
        """A new area of up to ``limit`` bytes, or None where ``/dev/shm`` is missing or full.
        Stale areas of dead processes are removed first."""
        remove_stale_areas()
        size = _area_size(limit)
        if size < MIN_AREA_BYTES:
            return None
        path = os.path.join(SHM_DIR, f"pipesvc-{process_id()}-{secrets.token_hex(16)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, HEADER_BYTES)
            os.mkfifo(path + BELL_SUFFIX, 0o600)
            return cls(fd, path, size)
        except OSError:
            os.close(fd)
            for leftover in (path, path + BELL_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            return None

    @property
    def size(self) -> int:
        """Bytes in the area, header included."""
        return self._map.size

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the area backed by memory now (header included)."""
        return self._reserved

    def write(self, tensor: torch.Tensor) -> Slot | None:
        """Copies ``tensor``'s bytes into a free slot; None when none fits now or the area
        was closed (send frames)."""
        data = _byte_view(tensor)
        # Locals: the mapping stays while this copy runs, even if another thread closes.
        area, mapped, consumed = self._map.bytes, self._map.mmap, self._map.consumed
        if area is None or mapped is None or data.numel() == 0:
            return None
        self._ring.release(int(consumed[0]))
        slot = self._ring.place(data.numel())
        if slot is None:
            return None
        start = HEADER_BYTES + slot.offset
        end = start + data.numel()
        self._trim(mapped, HEADER_BYTES + self._ring.high)
        if end > self._reserved:
            try:
                with self._fd.use() as fd:
                    os.posix_fallocate(fd, self._reserved, end - self._reserved)
            except OSError:
                self._ring.retract()
                return None
            self._reserved = end
        area[start:end].copy_(data)
        return Slot(slot.seq, start)

    def retract(self) -> None:
        """Takes back the slot of the last ``write`` (its doorbell message was never sent)."""
        self._ring.retract()

    def _trim(self, mapped: mmap.mmap, live_end: int) -> None:
        """Gives the pages above ``live_end`` back to the system (no live slot is there)."""
        keep = _page_up(live_end)
        excess = _page_up(self._reserved) - keep
        # Only once use has more than halved (and by a MiB): a link whose in-flight bytes
        # wobble by a slot does not free and fault the same pages on every send.
        if excess <= max(keep, _TRIM_MIN_BYTES):
            return
        try:
            mapped.madvise(mmap.MADV_REMOVE, keep, excess)
        except (OSError, ValueError) as exc:
            logger.debug("could not release shared-memory pages: %s", exc)
            return
        self._reserved = keep

    def open_bell(self) -> bool:
        """Opens the doorbell for writing; False unless the receiver holds it open to read."""
        try:
            fd = os.open(self.path + BELL_SUFFIX, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            return False
        with self._bell_lock:
            if self._closed:  # closed meanwhile: this end would never be closed
                os.close(fd)
                return False
            self._bell = SharedFd(fd, f"doorbell of {self.name}")
        return True

    def ring(self, message: bytes, cancelled: Callable[[], bool] | None = None) -> bool:
        """Writes one doorbell message, waiting while the pipe is full; False when
        ``cancelled()`` became true first (nothing was written).

        Raises:
            OSError: the receiver is gone (BrokenPipeError), or the bell is not open or was
                closed (EBADF).
        """
        if len(message) > MAX_BELL_MESSAGE:
            raise ValueError(
                f"doorbell message of {len(message)} bytes; at most {MAX_BELL_MESSAGE}"
            )
        bell = self._bell
        if bell is None:
            raise OSError(errno.EBADF, "the doorbell is not open")
        data = _LENGTH.pack(len(message)) + message
        with bell.use() as fd:
            poller = None  # made only when the pipe is full: most rings write at once
            while True:
                try:
                    os.write(fd, data)  # at most PIPE_BUF: all or nothing
                    return True
                except BlockingIOError:
                    pass
                if bell.closed:
                    raise OSError(errno.EBADF, f"the doorbell of {self.name} was closed")
                if cancelled is not None and cancelled():
                    return False
                if poller is None:
                    poller = select.poll()
                    poller.register(fd, select.POLLOUT)
                poller.poll(POLL_S * 1000)

    def unlink(self) -> None:
        """Removes the files; the mappings and open ends stay valid (called once the receiver
        answered)."""
        if not self._unlinked:
            self._unlinked = True
            for path in (self.path, self.path + BELL_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def close(self) -> None:
        """Unlinks, closes the doorbell (the receiver reads end-of-file once no ``ring`` is in
        flight) and drops the mapping (unmapped with its last user). Any thread, any time."""
        self.unlink()
        with self._bell_lock:
            self._closed = True
            bell = self._bell
        if bell is not None:
            bell.close()
        self._map.close()
        self._fd.close()


class ShmView:
    """The receiver's mapping of a peer's area."""

    def __init__(self, name: str, nonce: bytes, size: int, max_size: int) -> None:
        """Maps the offered area after checking name, file type, size and nonce.

        Raises:
            WireFormatError: the name is not an area name, or the size is out of bounds.
            OSError: the file cannot be opened or is not the offered one (another host).
        """
        if not AREA_NAME.fullmatch(name):
            raise WireFormatError(
                f"shared-memory area name {name!r} is not pipesvc-<pid>-<start>-<32 hex>"
            )
        if not HEADER_BYTES + ALIGN <= size <= max_size:
            raise WireFormatError(
                f"shared-memory area size {size} must be in [{HEADER_BYTES + ALIGN}, {max_size}]"
            )
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise OSError(f"{name} is not a {size}-byte regular file")
            mapping = Mapping(fd, size)
        finally:
            os.close(fd)
        assert mapping.bytes is not None
        if bytes(mapping.bytes[:_NONCE_BYTES].numpy()) != nonce:
            mapping.close()
            raise OSError(f"{name} does not carry the offered nonce (another host's area)")
        self.name = name
        self.size = size
        self._map = mapping
        self._last_seq = 0
        # Slots freed (by copies, or by the last tensor over them) and the highest number up
        # to which all are: what the sender may reuse. Freed from any thread, so an RLock.
        self._released: set[int] = set()
        self._published = 0
        self._release_lock = threading.RLock()
        self._closed = False
        try:
            self._bell = open_bell_reader(os.path.join(SHM_DIR, name + BELL_SUFFIX))
        except OSError:
            mapping.close()
            raise
        self._poller = select.poll()
        self._poller.register(self._bell, select.POLLIN)
        self._unread = bytearray()
        """Doorbell bytes read and not yet returned (see [Note: buffered doorbell])."""

    def read_bell(self) -> bytes | None:
        """The next doorbell message, blocking; None at end-of-file (the sender closed it) or
        once this view is closed (``close`` wakes a reader within a fraction of a second).
        Stages read with ``read_ready`` from their mailbox's poll instead; this is the plain
        blocking reader (tests, tools).

        [Note: buffered doorbell] Each ``ring`` writes its message whole (at most PIPE_BUF),
        so the reader takes whatever the pipe holds in one ``read`` and keeps what follows the
        message for the next call: one wait and one read per message, or fewer when several
        are waiting, instead of a wait and a read for the length and again for the body. Every
        system call lets the stage's compute thread take the GIL, and taking it back costs a
        switch between the threads.

        Raises:
            WireFormatError: a message longer than MAX_BELL_MESSAGE or cut short.
        """
        while self._bell >= 0:
            message = self._buffered_message()
            if message is not None:
                return message
            chunk = read_some(self._bell, _BELL_READ_BYTES, self._poller, self._is_closed)
            if self._closed:
                return None
            if chunk is None:
                if self._unread:
                    raise WireFormatError(
                        f"doorbell message cut short ({len(self._unread)} bytes of it arrived)"
                    )
                return None
            self._unread += chunk
        return None

    def fileno(self) -> int:
        """The doorbell's reading end (-1 once closed), for a caller's own ``poll``."""
        return self._bell

    def read_ready(self) -> list[bytes] | None:
        """The whole messages the doorbell holds now, without waiting (call it once ``poll``
        reported the doorbell readable: before its first writer has opened it, a FIFO reads as
        end-of-file); None at end-of-file or once this view is closed.

        Raises:
            WireFormatError: a message longer than MAX_BELL_MESSAGE or cut short.
        """
        if self._closed or self._bell < 0:
            return None
        try:
            chunk = os.read(self._bell, _BELL_READ_BYTES)
        except BlockingIOError:
            return []  # a spurious wake-up
        if not chunk:
            if self._unread:
                raise WireFormatError(
                    f"doorbell message cut short ({len(self._unread)} bytes of it arrived)"
                )
            return None
        self._unread += chunk
        messages = []
        while (message := self._buffered_message()) is not None:
            messages.append(message)
        return messages

    def _buffered_message(self) -> bytes | None:
        """The next whole message among the bytes read (taken out of them), if one is there.

        Raises:
            WireFormatError: its length is over MAX_BELL_MESSAGE.
        """
        unread = self._unread
        if len(unread) < _LENGTH_BYTES:
            return None
        (length,) = _LENGTH.unpack_from(unread)
        if length > MAX_BELL_MESSAGE:
            raise WireFormatError(f"doorbell message of {length} bytes; at most {MAX_BELL_MESSAGE}")
        end = _LENGTH_BYTES + length
        if len(unread) < end:
            return None
        message = bytes(unread[_LENGTH_BYTES:end])
        del unread[:end]
        return message

    def close_bell(self) -> None:
        """Closes the reading end (call from the thread that reads it, once it is done)."""
        if self._bell >= 0:
            os.close(self._bell)
            self._bell = -1

    def take(self, slot_seq: int, offset: int, num_bytes: int) -> torch.Tensor:
        """A byte tensor over a slot itself, no copy: the slot is freed when the last tensor
        sharing that memory is (slots freed out of order are published in order).

        Raises:
            WireFormatError: the slot is out of order or outside the area.
        """
        mapped = self._map.mmap
        if mapped is None:
            raise WireFormatError(f"shared-memory area {self.name} is closed")
        if slot_seq != self._last_seq + 1:
            raise WireFormatError(f"shared-memory slot {slot_seq}; expected {self._last_seq + 1}")
        end = offset + num_bytes
        if offset < HEADER_BYTES or end > self.size or num_bytes < 1:
            raise WireFormatError(
                f"shared-memory slot [{offset}, {end}) lies outside the area's data "
                f"[{HEADER_BYTES}, {self.size})"
            )
        array = numpy.frombuffer(mapped, dtype=numpy.uint8, count=num_bytes, offset=offset)
        weakref.finalize(array, self._release, slot_seq)
        self._last_seq = slot_seq
        return torch.from_numpy(array)

    def _release(self, slot_seq: int) -> None:
        with self._release_lock:
            self._released.add(slot_seq)
            while self._published + 1 in self._released:
                self._published += 1
                self._released.remove(self._published)
            if self._map.mmap is not None:
                self._map.consumed[0] = self._published

    def _is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drops the mapping (unmapped once the last tensor over a slot is gone) and wakes the
        doorbell's reader (which closes the doorbell)."""
        self._closed = True
        self._map.close()
