"""The coordinator's write-ahead log of step inputs, for replay after a failure (no gRPC here).

Every training step's inputs, targets and side inputs are written before its commit; recovery
restores the last checkpoint and replays the logged steps after it. Entries at or before the
newest checkpoint are pruned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipesvc.errors import NotFoundError
from pipesvc.storage.weights import load_weights, save_weights

_SIDE = "side."


@dataclass(frozen=True, slots=True)
class LoggedBatch:
    """A training step's whole batch: inputs, targets and side inputs by name."""

    inputs: torch.Tensor
    targets: torch.Tensor
    side: dict[str, torch.Tensor] = field(default_factory=dict)


class StepLog:
    """One safetensors file per step: ``step-{N:09d}.safetensors`` with inputs, targets and
    each side input (``side.<name>``)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, step: int) -> Path:
        return self.root / f"step-{step:09d}.safetensors"

    def write(self, step: int, batch: LoggedBatch) -> None:
        """Records step ``step``'s batch (atomically)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tensors = {"inputs": batch.inputs, "targets": batch.targets}
        tensors.update({_SIDE + name: t for name, t in batch.side.items()})
        save_weights(tensors, self._path(step))

    def read(self, step: int) -> LoggedBatch:
        """The batch of step ``step``.

        Raises:
            NotFoundError: the step is not in the log.
        """
        path = self._path(step)
        if not path.exists():
            raise NotFoundError(f"step {step} is not in the step log at {str(self.root)!r}")
        tensors = load_weights(path)
        side = {k[len(_SIDE) :]: t for k, t in tensors.items() if k.startswith(_SIDE)}
        return LoggedBatch(tensors["inputs"], tensors["targets"], side)

    def prune(self, up_to_step: int) -> None:
        """Removes every entry for steps <= ``up_to_step``."""
        if not self.root.is_dir():
            return
        for path in self.root.glob("step-*.safetensors"):
            number = path.name[5:].split(".", 1)[0]
            if number.isdigit() and int(number) <= up_to_step:
                path.unlink(missing_ok=True)
