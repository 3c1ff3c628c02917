"""The step log counts the bytes it holds (what bounds a ``checkpoint_every=0`` job's log, see
[Note: checkpoint cadence]) as entries are written, pruned behind a checkpoint and dropped
after a state loaded at an older step."""

from __future__ import annotations

from pathlib import Path

import torch

from pipesvc.coordinator.step_log import LoggedBatch, StepLog


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
