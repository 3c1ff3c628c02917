"""Shared-memory payloads between two stages on one host (no gRPC here).

[Note: the shared-memory path] A sender creates one area, a file under ``/dev/shm``, and offers
its name and a random nonce on the stream. A receiver that can open the file and finds the nonce
at its start shares the sender's host and ``/dev/shm``; it maps the area and accepts, and from
then on a payload is one ``memcpy`` into the area by the sender, and the receiver's tensor is the
area's memory itself, while the stream carries neither. A receiver that cannot open it
(another host, another container) refuses, and the stream keeps carrying frames. After the answer
the sender unlinks the file: both ends keep their mappings, and no file outlives a crash.

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
sending thread itself, and a thread of the receiver blocked on it wakes and delivers the tensor.
The stream stays the control path (offer, answer, fallback frames) and the liveness signal;
the doorbell takes gRPC's per-message cost (queues, its threads and completion queues on both
sides) off every activation and gradient, which is what small micro-batches are bound by. A
message is one ``write`` of at most ``PIPE_BUF`` bytes, so it is atomic; the writer blocks while
the pipe is full, and the reader sees end-of-file when the writer closes or dies.

Pages of a tmpfs file are allocated on first touch; writing to one when ``/dev/shm`` is full
raises SIGBUS. The sender therefore reserves pages with ``posix_fallocate`` before it first
writes past its high-water mark, which fails with an ordinary error instead.

Trust: a peer that has passed authentication and runs on the same host as the receiver could
shrink its file under the receiver's mapping and crash it (SIGBUS on a read), or change a
tensor it already sent; such a peer could equally signal the process. Names, offsets and sizes
from the stream are checked. The published counter is a plain aligned 8-byte store, read by the
sender after the receiver is done with the slot; x86-64 keeps that order, and the Python and
torch calls between the two are full barriers in practice elsewhere.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import re
import secrets
import select
import stat
import struct
import threading
import weakref
from dataclasses import dataclass

import numpy
import torch

from pipesvc.errors import WireFormatError

SHM_DIR = "/dev/shm"
DEFAULT_AREA_BYTES = 256 << 20
"""Largest area a sender creates (sparse: only touched pages use memory)."""
MIN_AREA_BYTES = 1 << 20
"""Below this (e.g. a nearly full ``/dev/shm``) no area is offered."""
MAX_AREA_BYTES = 1 << 40
"""Largest offered area a receiver maps (mapping reserves address space, not memory)."""
HEADER_BYTES = 4096
"""The nonce and the receiver's consumed counter live here; slots start after it."""
ALIGN = 64
_NONCE_BYTES = 16
_CONSUMED_OFFSET = 64
_NAME = re.compile(r"pipesvc-[0-9a-f]{32}")
_LENGTH_BYTES = 4
BELL_SUFFIX = ".bell"
MAX_BELL_MESSAGE = 4096 - _LENGTH_BYTES
"""Largest doorbell message body (a message and its length prefix are one atomic write)."""
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one payload went in an area."""

    seq: int
    offset: int


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Ring:
    """Slot placement in an area of ``capacity`` bytes (offsets from 0; pure bookkeeping)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._live: collections.deque[tuple[int, int, int]] = collections.deque()  # seq, start, end
        self._next_seq = 1

    @property
    def live(self) -> int:
        """Slots placed and not yet released."""
        return len(self._live)

    def release(self, consumed_seq: int) -> None:
        """Frees every slot numbered ``consumed_seq`` or lower."""
        while self._live and self._live[0][0] <= consumed_seq:
            self._live.popleft()

    def retract(self) -> None:
        """Takes back the newest slot (placed but never handed out)."""
        self._live.pop()
        self._next_seq -= 1

    def place(self, num_bytes: int) -> Slot | None:
        """The lowest slot for ``num_bytes`` that overlaps no live slot, or None when none fits
        now. Lowest first keeps a link's touched (resident) pages to what it has in flight."""
        size = _round_up(max(num_bytes, 1))
        start = 0
        for begin, end in sorted((begin, end) for _, begin, end in self._live):
            if begin - start >= size:
                break
            start = max(start, end)
        if start + size > self.capacity:
            return None
        slot = Slot(self._next_seq, start)
        self._live.append((slot.seq, start, start + size))
        self._next_seq += 1
        return slot


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


class _Mapping:
    """A mapped area file and a byte tensor over it."""

    def __init__(self, fd: int, size: int) -> None:
        mapped = mmap.mmap(fd, size)
        self.mmap: mmap.mmap | None = mapped
        self.bytes: torch.Tensor | None = torch.frombuffer(mapped, dtype=torch.uint8)
        self.consumed = self.bytes[_CONSUMED_OFFSET : _CONSUMED_OFFSET + 8].view(torch.int64)
        self.size = size

    def close(self) -> None:
        mapped, self.mmap = self.mmap, None
        self.bytes = None
        self.consumed = torch.zeros(1, dtype=torch.int64)
        if mapped is not None:
            # Tensors over its slots (or a copy in flight) may still use the mapping; then it
            # goes with the last of them.
            with contextlib.suppress(BufferError):
                mapped.close()


class ShmArea:
    """The sender's area: it writes payloads in; the receiver's tensors are its slots."""

    def __init__(self, fd: int, path: str, size: int) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self._fd = fd
        self._map = _Mapping(fd, size)
        assert self._map.bytes is not None
        self._map.bytes[:_NONCE_BYTES].copy_(
            torch.frombuffer(bytearray(self.nonce), dtype=torch.uint8)
        )
        self._ring = Ring(size - HEADER_BYTES)
        self._reserved = HEADER_BYTES
        self._unlinked = False
        self._bell = -1

    @classmethod
    def create(cls, limit: int = DEFAULT_AREA_BYTES) -> ShmArea | None:
        """A new area of up to ``limit`` bytes, or None where ``/dev/shm`` is missing or full."""
        size = _area_size(limit)
        if size < MIN_AREA_BYTES:
            return None
        path = os.path.join(SHM_DIR, f"pipesvc-{secrets.token_hex(16)}")
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

    def write(self, tensor: torch.Tensor) -> Slot | None:
        """Copies ``tensor``'s bytes into a free slot; None when none fits now (send frames)."""
        data = _byte_view(tensor)
        area = self._map.bytes
        if area is None or data.numel() == 0:
            return None
        self._ring.release(int(self._map.consumed[0]))
        slot = self._ring.place(data.numel())
        if slot is None:
            return None
        start = HEADER_BYTES + slot.offset
        end = start + data.numel()
        if end > self._reserved:
            try:
                os.posix_fallocate(self._fd, self._reserved, end - self._reserved)
            except OSError:
                self._ring.retract()
                return None
            self._reserved = end
        area[start:end].copy_(data)
        return Slot(slot.seq, start)

    def open_bell(self) -> bool:
        """Opens the doorbell for writing; False unless the receiver holds it open to read."""
        try:
            fd = os.open(self.path + BELL_SUFFIX, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            return False
        os.set_blocking(fd, True)
        self._bell = fd
        return True

    def ring(self, message: bytes) -> None:
        """Writes one doorbell message (blocks while the pipe is full).

        Raises:
            OSError: the receiver is gone (BrokenPipeError) or the bell is not open.
        """
        if len(message) > MAX_BELL_MESSAGE:
            raise ValueError(
                f"doorbell message of {len(message)} bytes; at most {MAX_BELL_MESSAGE}"
            )
        if self._bell < 0:
            raise OSError(errno.EBADF, "the doorbell is not open")
        os.write(self._bell, _LENGTH.pack(len(message)) + message)

    def unlink(self) -> None:
        """Removes the files; the mappings and open ends stay valid (called once the receiver
        answered)."""
        if not self._unlinked:
            self._unlinked = True
            for path in (self.path, self.path + BELL_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def close(self) -> None:
        """Unlinks, closes the doorbell (the receiver reads end-of-file) and unmaps."""
        self.unlink()
        if self._bell >= 0:
            os.close(self._bell)
            self._bell = -1
        self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShmView:
    """The receiver's mapping of a peer's area."""

    def __init__(self, name: str, nonce: bytes, size: int, max_size: int) -> None:
        """Maps the offered area after checking name, file type, size and nonce.

        Raises:
            WireFormatError: the name is not an area name, or the size is out of bounds.
            OSError: the file cannot be opened or is not the offered one (another host).
        """
        if not _NAME.fullmatch(name):
            raise WireFormatError(f"shared-memory area name {name!r} is not pipesvc-<32 hex>")
        if not HEADER_BYTES + ALIGN <= size <= max_size:
            raise WireFormatError(
                f"shared-memory area size {size} must be in [{HEADER_BYTES + ALIGN}, {max_size}]"
            )
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise OSError(f"{name} is not a {size}-byte regular file")
            mapping = _Mapping(fd, size)
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
        try:
            self._bell = _open_bell_reader(os.path.join(SHM_DIR, name + BELL_SUFFIX))
        except OSError:
            mapping.close()
            raise
        self._poller = select.poll()
        self._poller.register(self._bell, select.POLLIN)

    def read_bell(self) -> bytes | None:
        """The next doorbell message, blocking; None at end-of-file (the sender closed it).

        Raises:
            WireFormatError: a message longer than MAX_BELL_MESSAGE or cut short.
        """
        if self._bell < 0:
            return None
        head = _read_exact(self._bell, _LENGTH_BYTES, self._poller)
        if head is None:
            return None
        (length,) = _LENGTH.unpack(head)
        if length > MAX_BELL_MESSAGE:
            raise WireFormatError(f"doorbell message of {length} bytes; at most {MAX_BELL_MESSAGE}")
        body = _read_exact(self._bell, length, self._poller)
        if body is None:
            raise WireFormatError(f"doorbell message cut short ({length} bytes announced)")
        return body

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

    def close(self) -> None:
        """Unmaps (the doorbell is closed by its reading thread)."""
        self._map.close()


def _open_bell_reader(path: str) -> int:
    """Opens a doorbell FIFO for reading (non-blocking) without waiting for a writer.

    Raises:
        OSError: missing, or not a FIFO.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a FIFO")
    return fd


def _read_exact(fd: int, n: int, poller: select.poll) -> bytes | None:
    """``n`` bytes from the non-blocking FIFO ``fd``; None at end-of-file before the first
    byte. It waits in ``poll`` before reading: on Linux a FIFO reports hang-up only after a
    writer has come and gone, while ``read`` returns end-of-file whenever no writer is there,
    also before the first one has opened it."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        poller.poll()
        try:
            chunk = os.read(fd, n - got)
        except BlockingIOError:
            continue
        if not chunk:
            if got == 0:
                return None
            raise WireFormatError(f"doorbell closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
