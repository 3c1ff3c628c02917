"""The coordinator's write-ahead log of step inputs, for replay after a failure (no gRPC here).

Every training step's inputs, targets and side inputs are written before its commit; recovery
restores the last checkpoint and replays the logged steps after it. Entries at or before the
newest checkpoint are pruned, and so are those after a state loaded at an older step (a new
lineage).

[Note: step log segments]
A step's entry must be on disk before the step is decided, and short steps come hundreds a
second, so an entry costs one append and one ``fdatasync``: no file made, renamed and synced
into its directory per step (that cost three times the CPU and twice the wall time). Entries
are appended to *segments*, ``segment-{N:09d}.log`` (N counts up), each a run of records::

    header  (24 bytes: b"PSL2", step u64, length u64, CRC-32 of the payload u32,
             little-endian)
    payload (length bytes: the batch as a safetensors file)
    trailer (the header's 24 bytes again)

- One writer, entries in step order. A write opens the segment, appends, syncs and closes it
  again, so a log whose directory went away fails the write, as it must (the step is then
  aborted, see ``StepLogError``).
- A process never appends to a segment it did not start: after a crash the newest one may end
  in a torn record. A reader takes a segment's records up to the first one whose header,
  length or trailer is not whole; that record's step was never decided (its sync did not
  return), so nothing decided is lost.
- A record's payload is checked against its CRC-32 when it is read (for a replay): a record
  whose bytes changed on disk after their sync raises ``StepLogDamagedError`` naming the step
  and the file, rather than replaying other numbers than the step was decided with. The scan
  at start reads headers and trailers only.
- A step written twice (a step retried, or written again after a coordinator restart) is read
  from its newest record.
- A segment is removed once every record in it is at or before the newest checkpoint. A prune
  also starts the next segment, so segments follow checkpoint intervals; a segment is also
  closed once it holds ``SEGMENT_BYTES`` (large batches get one file each, as before).
  Pruned steps no longer read, though their bytes stay until their segment goes.
- A state loaded at an older step truncates each segment at its first record after that step.
- Logs written by earlier versions read as they were: records of 20-byte headers without a
  checksum (b"PSL1"), and one ``step-{N:09d}.safetensors`` file per step (one-record segments).
  A process never appends to such a segment, so each segment holds one kind of record.
- Whatever fails (a full disk, an I/O error, a directory gone), what the log reads follows
  what is on disk: a failed append is cut back (or its new segment removed) and the next write
  starts a new segment; a scan that failed is tried again; a drop cuts a file before it
  forgets the records; a prune forgets a segment once its file is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipesvc.errors import FailedPreconditionError, NotFoundError, StepAbortedError
from pipesvc.storage.weights import decode_weights, encode_weights, sync_path, write_pieces

_SIDE = "side."
_MAGIC = b"PSL2"
_HEADER = struct.Struct("<4sQQI")
_MAGIC_V1 = b"PSL1"
_HEADER_V1 = struct.Struct("<4sQQ")
"""Records of earlier versions: no checksum."""
SEGMENT_BYTES = 4 << 20
"""A segment is closed once it holds this many bytes (what a prune leaves behind is the
segment it falls into, and the one written since)."""
_SEGMENT = re.compile(r"segment-(\d{9})\.log")
_LEGACY = re.compile(r"step-(\d{9})\.safetensors")


class StepLogError(StepAbortedError):
    """A step's batch could not be written to the step log: the step was not decided and its
    run was aborted on every stage (a retry cannot be replayed without its batch, so none is
    made for the caller)."""


class StepLogDamagedError(FailedPreconditionError):
    """A step's record no longer matches its checksum: the disk changed its bytes after they
    were synced, so the step cannot be replayed as it was decided."""


@dataclass(frozen=True, slots=True)
class LoggedBatch:
    """A training step's whole batch: inputs, targets and side inputs by name."""

    inputs: torch.Tensor
    targets: torch.Tensor
    side: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class _Segment:
    """One file of the log and the records read from it, in order."""

    path: Path
    size: int = 0
    records: list[_Record] = field(default_factory=list)
    """Its whole records, in order."""


@dataclass(frozen=True, slots=True)
class _Record:
    """Where a step's record lies in its segment."""

    step: int
    offset: int
    """Of the payload."""
    length: int
    """Of the payload."""
    crc: int | None
    """The payload's CRC-32 (None: an earlier version's record, without one)."""
    trailer: int
    """Bytes after the payload (the copy of the header; none in a one-step file)."""

    @property
    def end(self) -> int:
        """Where the record ends in its segment."""
        return self.offset + self.length + self.trailer


class StepLog:
    """A job's step log in directory ``root`` (see [Note: step log segments])."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()  # written in a step's run, pruned by a background checkpoint
        self._segments: dict[int, _Segment] | None = None
        """Every segment by number, once read (kept up to date from then on)."""
        self._where: dict[int, tuple[int, _Record]] = {}
        """Each step's newest record, with its segment's number."""
        self._open: int | None = None
        """The segment this process appends to, if any."""
        self._pruned = 0
        """Steps at or before this no longer read."""
        self._next = 1
        """The number of the next segment to start (once read: past every one on disk)."""

    def write(self, step: int, batch: LoggedBatch) -> None:
        """Records step ``step``'s batch: on disk when this returns."""
        tensors = {"inputs": batch.inputs, "targets": batch.targets}
        tensors.update({_SIDE + name: t for name, t in batch.side.items()})
        payload = encode_weights(tensors)
        length = sum(piece.nbytes for piece in payload)
        crc = 0
        for piece in payload:
            crc = zlib.crc32(piece, crc)
        header = memoryview(_HEADER.pack(_MAGIC, step, length, crc))
        with self._lock:
            segments = self._scanned()
            number = self._open
            if number is None or segments[number].size >= SEGMENT_BYTES:
                number, self._next = self._next, self._next + 1  # never a name tried before
            segment = segments.get(number) or _Segment(self.root / f"segment-{number:09d}.log")
            self._append(segment, [header, *payload, header])
            segments[number] = segment
            record = _Record(step, segment.size + _HEADER.size, length, crc, _HEADER.size)
            segment.records.append(record)
            segment.size = record.end
            self._where[step] = (number, record)
            self._open = number

    def _append(self, segment: _Segment, pieces: list[memoryview]) -> None:
        """Appends ``pieces`` to ``segment``'s file and syncs it. On failure a new file is
        removed and an older one cut back; either way the next write starts a new segment."""
        new = segment.size == 0
        self._open = None  # until this write succeeds: on failure the next starts a segment
        if new and not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            sync_path(self.root.parent)
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if new else 0)
        fd = os.open(segment.path, flags, 0o644)
        try:
            write_pieces(fd, pieces)
            _sync_data(fd)
            if new:
                sync_path(self.root)
        except BaseException:
            with contextlib.suppress(OSError):
                if new:
                    os.unlink(segment.path)
                else:
                    os.ftruncate(fd, segment.size)
            raise
        finally:
            os.close(fd)

    def read(self, step: int) -> LoggedBatch:
        """The batch of step ``step``.

        Raises:
            NotFoundError: the step is not in the log.
        """
        with self._lock:
            segments = self._scanned()
            found = self._where.get(step) if step > self._pruned else None
            if found is None:
                raise NotFoundError(f"step {step} is not in the step log at {str(self.root)!r}")
            number, record = found
            path = segments[number].path
        try:
            with open(path, "rb") as file:
                file.seek(record.offset)
                data = file.read(record.length)
        except FileNotFoundError:  # pruned meanwhile
            data = b""
        if len(data) != record.length:  # removed or cut meanwhile
            raise NotFoundError(f"step {step} is not in the step log at {str(self.root)!r}")
        crc = zlib.crc32(data) if record.crc is not None else None
        if crc != record.crc:
            raise StepLogDamagedError(
                f"step {step}'s record in the step log ({str(path)!r}, bytes {record.offset} to "
                f"{record.offset + record.length}) does not match its checksum (CRC-32 "
                f"{crc:#010x}, written as {record.crc:#010x}): the disk changed it "
                "after it was synced, so the step cannot be replayed as it was decided"
            )
        tensors = decode_weights(data, where=f"step {step} in {str(path)!r}")
        side = {k[len(_SIDE) :]: t for k, t in tensors.items() if k.startswith(_SIDE)}
        return LoggedBatch(tensors["inputs"], tensors["targets"], side)

    def entries(self) -> dict[int, Path]:
        """The file that holds each step's entry, by step."""
        with self._lock:
            segments = self._scanned()
            return {
                step: segments[number].path
                for step, (number, _) in self._where.items()
                if step > self._pruned
            }

    def size_bytes(self) -> int:
        """Bytes the log takes on disk."""
        with self._lock:
            return sum(segment.size for segment in self._scanned().values())

    def prune(self, up_to_step: int) -> None:
        """Entries for steps <= ``up_to_step`` no longer read; every segment that holds no
        other is removed, and the next write starts a new segment."""
        with self._lock:
            segments = self._scanned()
            self._pruned = max(self._pruned, up_to_step)
            behind = [
                number
                for number, segment in segments.items()
                if all(record.step <= up_to_step for record in segment.records)
            ]
            try:
                for number in behind:
                    self._remove(number)
            finally:
                self._index()
                self._open = None

    def drop_after(self, step: int) -> None:
        """Removes every entry for steps > ``step`` (a lineage that loading state superseded;
        only while no entry is being written)."""
        with self._lock:
            segments = self._scanned()
            self._pruned = min(self._pruned, step)
            try:
                for number, segment in list(segments.items()):
                    # Records are in step order: the ones kept come first.
                    cut = next((i for i, r in enumerate(segment.records) if r.step > step), None)
                    if cut == 0:
                        self._remove(number)
                    elif cut is not None:
                        size = segment.records[cut - 1].end
                        os.truncate(segment.path, size)
                        sync_path(segment.path)
                        del segment.records[cut:]  # only once the file is cut
                        segment.size = size
            finally:
                self._index()
                self._open = None

    def _remove(self, number: int) -> None:
        """Removes a segment's file, then forgets it (the caller rebuilds the index)."""
        assert self._segments is not None
        self._segments[number].path.unlink(missing_ok=True)
        del self._segments[number]

    def _index(self) -> None:
        """Rebuilds ``_where`` from the segments (the newest record of a step wins)."""
        assert self._segments is not None
        self._where = {}
        for number in sorted(self._segments):
            self._where.update((r.step, (number, r)) for r in self._segments[number].records)

    def _scanned(self) -> dict[int, _Segment]:
        """The segments, read from disk the first time (the lock is held; a scan that fails
        is tried again by the next call)."""
        if self._segments is None:
            segments: dict[int, _Segment] = {}
            legacy: dict[int, int] = {}
            paths = sorted(self.root.iterdir()) if self.root.is_dir() else []
            for path in paths:
                if match := _SEGMENT.fullmatch(path.name):
                    segments[int(match[1])] = _read_segment(path)
                elif match := _LEGACY.fullmatch(path.name):
                    legacy[int(match[1])] = path.stat().st_size
            # An older version's files, one step each, come before any segment.
            first = min(segments, default=1) - len(legacy)
            for offset, (step, size) in enumerate(sorted(legacy.items())):
                path = self.root / f"step-{step:09d}.safetensors"
                segments[first + offset] = _Segment(path, size, [_Record(step, 0, size, None, 0)])
            self._next = max(segments, default=0) + 1
            self._segments = segments
            self._index()
        return self._segments


def _read_segment(path: Path) -> _Segment:
    """A segment's whole records, up to the first torn one (headers and trailers are read, not
    payloads)."""
    segment = _Segment(path)
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        offset = 0
        while True:
            file.seek(offset)
            head = file.read(_HEADER.size)  # the longer header; a V1 record uses its start
            magic = head[:4]
            form = _HEADER if magic == _MAGIC else _HEADER_V1 if magic == _MAGIC_V1 else None
            if form is None or offset + 2 * form.size > size:
                break
            header = head[: form.size]
            _, step, length, *crc = form.unpack(header)
            record = _Record(step, offset + form.size, length, crc[0] if crc else None, form.size)
            if record.end > size:
                break
            file.seek(record.end - form.size)
            if file.read(form.size) != header:
                break
            segment.records.append(record)
            offset = record.end
    segment.size = size
    return segment


def _sync_data(fd: int) -> None:
    """Flushes a file's data (and the size that reads it) to disk."""
    sync = getattr(os, "fdatasync", os.fsync)  # fdatasync is POSIX's, not every system's
    sync(fd)
