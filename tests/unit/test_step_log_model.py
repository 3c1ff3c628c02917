"""The step log against a model of what it promises (see [Note: step log segments]), driven by
random runs of what a coordinator does to it: steps written in order and retried, prunes
behind checkpoints, older lineages dropped, restarts, writes that fail part way (a full disk)
crashes that leave a torn record, and bytes that rot on disk after their sync, with segments
small enough that every run crosses many of them. After every action each step the model holds
must read back exactly, a step whose bytes rotted must be refused as damaged (never read as
other numbers), and every other step must be refused as absent."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pipesvc.coordinator import step_log
from pipesvc.coordinator.step_log import LoggedBatch, StepLog, StepLogDamagedError
from pipesvc.errors import NotFoundError
from tests.support.step_log_rot import flip_payload_bit

SEGMENT_BYTES = 700
"""Small enough that a segment holds one to a few entries (each is 190-640 bytes)."""


def _batch(mark: int, rows: int, side: bool) -> LoggedBatch:
    """A batch whose every value is ``mark``: what a read gives back names the write it came
    from."""
    extra = {"attention_mask": torch.full((rows, 2), mark, dtype=torch.int64)} if side else {}
    return LoggedBatch(torch.full((rows, 3), float(mark)), torch.full((rows,), float(-mark)), extra)


_WHOLE = 1 << 20
"""A torn length past any record: all of it is written."""


def _failing_write(fd: int, pieces: Sequence[memoryview]) -> None:
    """Writes the first piece, then fails as a full disk does."""
    os.write(fd, pieces[0])
    raise OSError(errno.ENOSPC, "No space left on device")


class StepLogModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="steplog-model-")) / "steps"
        self.log = StepLog(self.root)
        self.held: dict[int, int] = {}  # step -> mark of its newest durable write
        self.rotted: set[int] = set()  # held steps whose newest record's payload changed on disk
        self.pruned = 0  # steps at or before this are behind the newest checkpoint
        self.step = 0  # the newest step written
        self.marks = 0
        self.appending = False  # this process has a segment it appends to (a crash may tear)

    def teardown(self) -> None:
        patch = getattr(self, "_patch", None)
        if patch is not None:
            patch.stop()
        shutil.rmtree(self.root.parent, ignore_errors=True)

    @initialize()
    def small_segments(self) -> None:
        self._patch = mock.patch.object(step_log, "SEGMENT_BYTES", SEGMENT_BYTES)
        self._patch.start()

    def _mark(self) -> int:
        self.marks += 1
        return self.marks

    @rule(rows=st.integers(1, 12), side=st.booleans(), again=st.booleans())
    def write(self, rows: int, side: bool, again: bool) -> None:
        """The next step, or the newest again (a retried step)."""
        step = self.step if again and self.step > self.pruned else self.step + 1
        mark = self._mark()
        self.log.write(step, _batch(mark, rows, side))
        self.held[step] = mark
        self.rotted.discard(step)
        self.step = step
        self.appending = True

    @rule(rows=st.integers(1, 12))
    def write_fails(self, rows: int) -> None:
        """A write that fails part way: nothing is held, the log stays writable."""
        failing = mock.patch.object(step_log, "write_pieces", _failing_write)
        with failing, pytest.raises(OSError):
            self.log.write(self.step + 1, _batch(self._mark(), rows, False))

    @precondition(lambda self: self.step > self.pruned)
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        """A checkpoint at a step already written prunes the log behind it."""
        at = data.draw(st.integers(self.pruned + 1, self.step))
        self.log.prune(at)
        self.pruned = at

    def _rottable(self) -> list[int]:
        """Held steps past the checkpoint whose newest record has not rotted yet (once per
        record: a second flip could put the same bit back)."""
        return sorted(s for s in self.held if s > self.pruned and s not in self.rotted)

    @precondition(lambda self: self._rottable())
    @rule(data=st.data())
    def rot(self, data: st.DataObject) -> None:
        """One byte of a held step's newest payload changes on disk (its header and trailer
        stay whole, so nothing but the checksum can tell)."""
        step = data.draw(st.sampled_from(self._rottable()))
        bit = data.draw(st.integers(0, 7))
        flip_payload_bit(self.log, step, lambda n: data.draw(st.integers(0, n - 1)), bit)
        self.rotted.add(step)

    @precondition(lambda self: self.step > 0)
    @rule(data=st.data())
    def load_older(self, data: st.DataObject) -> None:
        """State loaded at an older step: a checkpoint there, then the later steps dropped
        (what ``Checkpointer.load`` does)."""
        at = data.draw(st.integers(0, self.step - 1))
        self.log.prune(at)
        self.log.drop_after(at)
        self.held = {s: m for s, m in self.held.items() if s <= at}
        self.rotted = {s for s in self.rotted if s <= at}
        self.pruned = at
        self.step = at

    @rule(torn=st.integers(0, 60) | st.just(_WHOLE))
    def restart(self, torn: int) -> None:
        """The coordinator stops (maybe mid-write, leaving ``torn`` bytes of a record that was
        never acknowledged, or all of it but a trailer that does not match) and a new one opens
        the log and prunes to the checkpoint. Only the segment a process was appending to can
        be torn, once: no process appends to a segment it did not start."""
        segments = sorted(self.root.glob("segment-*.log")) if self.root.is_dir() else []
        if torn and segments and self.appending:
            header = step_log._HEADER.pack(
                step_log._MAGIC, self.step + 1, 64, zlib.crc32(bytes(64))
            )
            record = header + bytes(64) + bytes(len(header))
            with open(segments[-1], "ab") as file:
                file.write(record[:torn])
        self.log = StepLog(self.root)
        self.log.prune(self.pruned)
        self.appending = False

    @invariant()
    def reads_follow_the_model(self) -> None:
        readable = {s: m for s, m in self.held.items() if s > self.pruned}
        assert set(self.log.entries()) == set(readable)
        for step, mark in readable.items():
            if step in self.rotted:
                with pytest.raises(StepLogDamagedError, match=f"step {step}'s record"):
                    self.log.read(step)
                continue
            batch = self.log.read(step)
            assert torch.all(batch.inputs == mark) and torch.all(batch.targets == -mark)
            side = batch.side.get("attention_mask")
            assert side is None or torch.all(side == mark)
        for step in range(0, self.step + 3):
            if step not in readable:
                with pytest.raises(NotFoundError):
                    self.log.read(step)

    @invariant()
    def the_bytes_held_are_the_files(self) -> None:
        on_disk = sum(p.stat().st_size for p in self.root.iterdir()) if self.root.is_dir() else 0
        assert self.log.size_bytes() <= on_disk  # a torn tail is on disk but not held


StepLogModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("STEPLOG_EXAMPLES", 60)),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_step_log_keeps_what_it_promises = StepLogModel.TestCase
