"""A job refuses to load a state at a step outside 0..2^63-1 (what its database row holds)
before it reads a frame or calls a stage. The job here has no stages: any call to one, or
any frame drawn, would show."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipesvc.coordinator.database import StateDB
from pipesvc.coordinator.job import JobDriver
from pipesvc.coordinator.job_storage import JobStorage
from pipesvc.coordinator.stage_calls import Deadlines
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.core.config import JobConfig
from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import common_pb2


@pytest.mark.parametrize("step", [-1, 2**63, 2**64 - 1])
def test_a_step_out_of_range_is_refused_before_anything_is_read(tmp_path: Path, step: int) -> None:
    db = StateDB(tmp_path)
    job = JobDriver(
        job_id="j",
        config=JobConfig(model="mlp"),
        layers=[],
        plan=[],
        registry=StageRegistry(),
        deadlines=Deadlines(),
        storage=JobStorage(db, tmp_path / "jobs" / "j"),
    )
    drawn: list[int] = []

    def frames() -> Iterator[common_pb2.TensorFrame]:
        drawn.append(1)
        yield common_pb2.TensorFrame(name="0.weight")

    with pytest.raises(InvalidArgumentError, match=rf"step {step} is out of range.*2\^63-1"):
        job.load_state(frames(), step)
    assert drawn == []
    assert job.step == 0 and db.open_jobs() == []
    job.close()
    db.close()
