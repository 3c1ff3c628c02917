"""Side inputs (the padding attention mask): checked against the batch, split at the inputs'
rows, and logged with the step (see [Note: side inputs])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipesvc.coordinator.step_log import LoggedBatch, StepLog
from pipesvc.core.microbatch import RunBatch, check_side
from pipesvc.errors import InvalidArgumentError

IDS = torch.arange(7 * 5).reshape(7, 5)


def test_side_inputs_split_at_the_rows_of_the_inputs() -> None:
    mask = torch.ones(7, 5, dtype=torch.long)
    mask[3, :2] = 0
    batch = RunBatch.split(IDS, IDS + 1, {"attention_mask": mask}, 3)
    assert [mb.shape[0] for mb in batch.inputs] == [3, 2, 2]
    for inputs, targets, side in zip(batch.inputs, batch.targets, batch.side, strict=True):
        rows = inputs[:, 0] // 5
        assert torch.equal(targets, inputs + 1)
        assert torch.equal(side["attention_mask"], mask[rows])
    assert RunBatch.split(IDS, None, None, 2).side == []


@pytest.mark.parametrize(
    ("side", "message"),
    [
        ({"position_ids": torch.ones(7, 5, dtype=torch.long)}, "'position_ids' is unknown"),
        ({"attention_mask": torch.ones(7, 4, dtype=torch.long)}, r"shape \[7, 4\].*\[7, 5\]"),
        ({"attention_mask": torch.ones(7)}, r"shape \[7\]"),
        ({"attention_mask": torch.ones(7, 5)}, "dtype torch.float32; expected bool or int"),
        ({"attention_mask": torch.full((7, 5), 2)}, "only 0 and 1"),
    ],
)
def test_side_inputs_that_do_not_fit_are_refused(
    side: dict[str, torch.Tensor], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        check_side(IDS, side)


def test_a_logged_step_keeps_its_side_inputs(tmp_path: Path) -> None:
    log = StepLog(tmp_path)
    mask = torch.tensor([[0, 1, 1, 1, 1]] * 7, dtype=torch.bool)
    log.write(3, LoggedBatch(IDS, IDS + 1, {"attention_mask": mask}))
    log.write(4, LoggedBatch(IDS, IDS + 2))
    three, four = log.read(3), log.read(4)
    assert torch.equal(three.inputs, IDS) and torch.equal(three.targets, IDS + 1)
    assert list(three.side) == ["attention_mask"]
    assert torch.equal(three.side["attention_mask"], mask)
    assert four.side == {}
