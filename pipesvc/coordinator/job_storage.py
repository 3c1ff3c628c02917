"""Where a job's durable state lives: the database row, checkpoints and the step log."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipesvc.coordinator.database import StateDB
from pipesvc.coordinator.step_log import StepLog
from pipesvc.storage.checkpoint import CheckpointStore


@dataclass
class JobStorage:
    """Where a job's durable state lives: the database row, checkpoints and the step log."""

    db: StateDB
    root: Path
    checkpoints: CheckpointStore = field(init=False)
    log: StepLog = field(init=False)

    def __post_init__(self) -> None:
        self.checkpoints = CheckpointStore(self.root / "checkpoints")
        self.log = StepLog(self.root / "steps")
