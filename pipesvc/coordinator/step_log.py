"""The coordinator's write-ahead log of step inputs, for replay after a failure (no gRPC here).

Every training step's micro-batch inputs and targets are written before its commit; recovery
restores the last checkpoint and replays the logged steps after it. Entries at or before the
newest checkpoint are pruned.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipesvc.errors import NotFoundError
from pipesvc.storage.weights import load_weights, save_weights


class StepLog:
    """One safetensors file per step: ``step-{N:09d}.safetensors`` with inputs and targets."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, step: int) -> Path:
        return self.root / f"step-{step:09d}.safetensors"

    def write(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Records step ``step``'s batch (atomically)."""
        self.root.mkdir(parents=True, exist_ok=True)
        save_weights({"inputs": inputs, "targets": targets}, self._path(step))

    def read(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of step ``step``.

        Raises:
            NotFoundError: the step is not in the log.
        """
        path = self._path(step)
        if not path.exists():
            raise NotFoundError(f"step {step} is not in the step log at {str(self.root)!r}")
        batch = load_weights(path)
        return batch["inputs"], batch["targets"]

    def prune(self, up_to_step: int) -> None:
        """Removes every entry for steps <= ``up_to_step``."""
        if not self.root.is_dir():
            return
        for path in self.root.glob("step-*.safetensors"):
            number = path.name[5:].split(".", 1)[0]
            if number.isdigit() and int(number) <= up_to_step:
                path.unlink(missing_ok=True)
