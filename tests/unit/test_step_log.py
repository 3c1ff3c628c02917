"""The step log appends entries to segments (see [Note: step log segments]) and counts the
bytes it holds (what bounds a ``checkpoint_every=0`` job's log, see
[Note: checkpoint cadence]) as entries are written, pruned behind a checkpoint and dropped
after a state loaded at an older step."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest
import torch

from pipesvc.coordinator import step_log
from pipesvc.coordinator.step_log import (
    SEGMENT_BYTES,
    LoggedBatch,
    StepLog,
    StepLogDamagedError,
)
from pipesvc.errors import NotFoundError
from pipesvc.storage.weights import encode_weights, save_weights


def _on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir())


def test_the_bytes_held_follow_writes_prunes_and_drops(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps")
    assert log.size_bytes() == 0
    for step in range(1, 7):
        log.write(step, LoggedBatch(torch.randn(4 * step, 3), torch.randn(4 * step, 2)))
        assert log.size_bytes() == _on_disk(log.root)
    log.prune(2)
    assert sorted(log.entries()) == [3, 4, 5, 6]
    assert log.size_bytes() == _on_disk(log.root)
    log.drop_after(4)
    assert sorted(log.entries()) == [3, 4]
    assert log.size_bytes() == _on_disk(log.root)
    log.write(5, LoggedBatch(torch.randn(1, 3), torch.randn(1, 2)))  # a new lineage's step 5
    assert StepLog(log.root).size_bytes() == log.size_bytes() == _on_disk(log.root)
    assert log.read(5).inputs.shape == (1, 3)


def _batch(step: int, rows: int = 2) -> LoggedBatch:
    g = torch.Generator().manual_seed(step)
    return LoggedBatch(torch.randn(rows, 3, generator=g), torch.randn(rows, 2, generator=g))


def _same(a: LoggedBatch, b: LoggedBatch) -> bool:
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_small_entries_share_a_segment_and_a_prune_removes_only_whole_ones(
    tmp_path: Path,
) -> None:
    log = StepLog(tmp_path / "steps")
    for step in range(1, 6):
        log.write(step, _batch(step))
    assert len(list(log.root.iterdir())) == 1  # appended: no file per step
    log.prune(3)  # the segment still holds steps 4 and 5
    assert sorted(log.entries()) == [4, 5]
    assert len(list(log.root.iterdir())) == 1
    for step in range(6, 9):
        log.write(step, _batch(step))  # a prune starts the next segment
    assert len(list(log.root.iterdir())) == 2
    log.prune(5)
    assert [p.name for p in log.root.iterdir()] == ["segment-000000002.log"]
    reopened = StepLog(log.root)
    assert sorted(reopened.entries()) == [6, 7, 8]
    assert all(_same(reopened.read(s), _batch(s)) for s in (6, 7, 8))
    with pytest.raises(NotFoundError):
        log.read(4)


def test_an_entry_as_large_as_a_segment_gets_a_file_of_its_own(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps")
    rows = SEGMENT_BYTES // (5 * 4) + 1
    log.write(1, _batch(1, rows))
    log.write(2, _batch(2))
    assert len(list(log.root.iterdir())) == 2
    log.prune(1)
    assert sorted(StepLog(log.root).entries()) == [2]


def test_a_torn_tail_loses_only_the_entry_being_written(tmp_path: Path) -> None:
    """A crash during an append leaves part of a record: a new process reads every whole one
    before it, and appends to a new segment."""
    log = StepLog(tmp_path / "steps")
    for step in (1, 2, 3):
        log.write(step, _batch(step))
    (segment,) = log.root.iterdir()
    whole = segment.read_bytes()
    for cut in (7, 20, 200, len(whole) // 3 - 5):  # inside the header, the payload, the trailer
        segment.write_bytes(whole + whole[:cut])
        reopened = StepLog(log.root)
        assert sorted(reopened.entries()) == [1, 2, 3]
        assert reopened.size_bytes() == len(whole) + cut
    reopened.write(4, _batch(4))
    again = StepLog(log.root)
    assert sorted(again.entries()) == [1, 2, 3, 4]
    assert all(_same(again.read(s), _batch(s)) for s in (1, 2, 3, 4))


def test_a_step_written_again_reads_its_newest_entry(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps")
    log.write(1, _batch(1))
    log.write(2, _batch(20))
    log.write(2, _batch(21))  # a retried step
    assert _same(log.read(2), _batch(21))
    restarted = StepLog(log.root)
    restarted.write(2, _batch(22))  # written again after a coordinator restart
    for reader in (restarted, StepLog(log.root)):
        assert _same(reader.read(2), _batch(22))
        assert _same(reader.read(1), _batch(1))


def test_dropping_a_lineage_cuts_its_segment_on_disk(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps")
    for step in range(1, 6):
        log.write(step, _batch(step))
    log.drop_after(2)
    log.write(3, _batch(30))  # the new lineage's step 3
    reopened = StepLog(log.root)
    assert sorted(reopened.entries()) == [1, 2, 3]
    assert _same(reopened.read(3), _batch(30))
    assert reopened.size_bytes() == _on_disk(log.root)


@pytest.mark.parametrize("failing_step", [1, 2])
def test_a_failed_append_leaves_the_entries_before_it_whole(
    failing_step: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills halfway through a record (the first of a new segment, or one appended
    to a segment): the write fails, the new file goes or the segment is cut back, and the
    next write and every earlier entry read, then and after a restart."""
    log = StepLog(tmp_path / "steps")
    for step in range(1, failing_step):
        log.write(step, _batch(step))
    real = step_log.write_pieces

    def half_then_full(fd: int, pieces: list[memoryview]) -> None:
        os.write(fd, bytes(pieces[0])[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(step_log, "write_pieces", half_then_full)
    with pytest.raises(OSError, match="No space"):
        log.write(failing_step, _batch(failing_step))
    monkeypatch.setattr(step_log, "write_pieces", real)
    assert log.size_bytes() == _on_disk(log.root)
    for step in range(failing_step, 4):
        log.write(step, _batch(step))
    for reader in (log, StepLog(log.root)):
        assert sorted(reader.entries()) == [1, 2, 3]
        assert all(_same(reader.read(s), _batch(s)) for s in (1, 2, 3))


def test_a_log_written_by_an_earlier_version_reads_and_prunes(tmp_path: Path) -> None:
    """Earlier versions wrote one safetensors file per step."""
    root = tmp_path / "steps"
    root.mkdir()
    for step in (4, 5):
        b = _batch(step)
        save_weights(
            {"inputs": b.inputs, "targets": b.targets}, root / f"step-{step:09d}.safetensors"
        )
    log = StepLog(root)
    assert sorted(log.entries()) == [4, 5]
    log.write(6, _batch(6))
    assert all(_same(log.read(s), _batch(s)) for s in (4, 5, 6))
    assert log.size_bytes() == _on_disk(root)
    log.prune(5)
    assert [p.name for p in root.iterdir()] == ["segment-000000001.log"]


def test_a_record_whose_bytes_changed_on_disk_is_refused_as_damaged(tmp_path: Path) -> None:
    """A payload byte that flips after its sync (the header and trailer still whole) is caught
    by the record's checksum when the step is read for a replay: the read names the step and
    the file instead of handing over other numbers. The records around it still read, and a
    retry of the step (written again) reads from its new record."""
    log = StepLog(tmp_path / "steps")
    for step in (1, 2, 3):
        log.write(step, _batch(step, rows=64))
    (segment,) = log.root.iterdir()
    data = bytearray(segment.read_bytes())
    third = len(data) // 3
    at = third + third // 2  # inside step 2's payload: its tensors' bytes, far from its header
    data[at] ^= 0x04
    segment.write_bytes(bytes(data))
    for reader in (log, StepLog(log.root)):  # this process, and one that scans the log afresh
        assert sorted(reader.entries()) == [1, 2, 3]  # a scan reads headers, not payloads
        with pytest.raises(StepLogDamagedError, match=r"step 2's record .*checksum") as info:
            reader.read(2)
        assert str(segment) in str(info.value)
        assert _same(reader.read(1), _batch(1, 64)) and _same(reader.read(3), _batch(3, 64))
    log.write(2, _batch(2, rows=64))
    assert _same(log.read(2), _batch(2, rows=64))


def test_records_without_a_checksum_read_as_before(tmp_path: Path) -> None:
    """A log that an earlier version wrote in records of 20-byte headers with no checksum
    (b"PSL1") reads, prunes and drops as before; new entries go to a new segment, with one."""
    root = tmp_path / "steps"
    root.mkdir()
    old = bytearray()
    for step in (1, 2, 3):
        b = _batch(step)
        payload = b"".join(
            bytes(p) for p in encode_weights({"inputs": b.inputs, "targets": b.targets})
        )
        header = struct.pack("<4sQQ", b"PSL1", step, len(payload))
        old += header + payload + header
    (root / "segment-000000001.log").write_bytes(bytes(old))
    log = StepLog(root)
    assert sorted(log.entries()) == [1, 2, 3]
    assert all(_same(log.read(s), _batch(s)) for s in (1, 2, 3))
    log.write(4, _batch(4))
    assert sorted(p.name for p in root.iterdir()) == [
        "segment-000000001.log",
        "segment-000000002.log",
    ]
    assert log.size_bytes() == _on_disk(root)
    log.drop_after(2)  # cuts the old segment after its second record
    assert (root / "segment-000000001.log").stat().st_size == len(old) * 2 // 3
    again = StepLog(root)
    assert sorted(again.entries()) == [1, 2]
    assert all(_same(again.read(s), _batch(s)) for s in (1, 2))


def _fail_once(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """``owner.name`` raises OSError (EIO) on its next call, then works again."""
    real = getattr(owner, name)
    calls = []

    def failing(*args: object, **kwargs: object) -> object:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def test_a_scan_that_failed_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted coordinator's first look at the log fails (out of file descriptors, an
    I/O error): the next call reads the whole log, and writes go past every segment."""
    log = StepLog(tmp_path / "steps")
    for step in (1, 2):
        log.write(step, _batch(step))
    restarted = StepLog(log.root)
    _fail_once(monkeypatch, step_log, "_read_segment")
    with pytest.raises(OSError, match="Input/output"):
        restarted.read(2)
    assert _same(restarted.read(2), _batch(2))
    restarted.write(3, _batch(3))
    assert sorted(StepLog(log.root).entries()) == [1, 2, 3]


def test_a_drop_whose_cut_failed_keeps_reading_what_is_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The segment could not be cut: the log still reads the records the file holds, and a
    new lineage's step written next reads as itself, then and after a restart."""
    log = StepLog(tmp_path / "steps")
    for step in range(1, 6):
        log.write(step, _batch(step))
    _fail_once(monkeypatch, os, "truncate")
    with pytest.raises(OSError, match="Input/output"):
        log.drop_after(2)
    log.write(3, _batch(30))
    for reader in (log, StepLog(log.root)):
        assert _same(reader.read(3), _batch(30))
        assert _same(reader.read(2), _batch(2))
    log.drop_after(2)  # tried again: it works
    assert sorted(StepLog(log.root).entries()) == [1, 2]


def test_a_prune_whose_removal_failed_leaves_the_log_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = StepLog(tmp_path / "steps")
    for step in (1, 2):
        log.write(step, _batch(step))
    _fail_once(monkeypatch, Path, "unlink")
    with pytest.raises(OSError, match="Input/output"):
        log.prune(2)
    assert log.size_bytes() == _on_disk(log.root)
    log.write(3, _batch(3))
    assert sorted(log.entries()) == [3]
    log.prune(2)
    assert sorted(StepLog(log.root).entries()) == [3]
    assert log.size_bytes() == _on_disk(log.root)
