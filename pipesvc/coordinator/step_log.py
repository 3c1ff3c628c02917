"""The coordinator's write-ahead log of step inputs, for replay after a failure (no gRPC here).

Every training step's inputs, targets and side inputs are written before its commit; recovery
restores the last checkpoint and replays the logged steps after it. Entries at or before the
newest checkpoint are pruned, and so are those after a state loaded at an older step (a new
lineage).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipesvc.errors import NotFoundError, StepAbortedError
from pipesvc.storage.weights import load_weights, save_weights

_SIDE = "side."


class StepLogError(StepAbortedError):
    """A step's batch could not be written to the step log: the step was not decided and its
    run was aborted on every stage (a retry cannot be replayed without its batch, so none is
    made for the caller)."""


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
        self._lock = threading.Lock()  # written in a step's run, pruned by a background checkpoint
        self._sizes: dict[int, int] | None = None
        """Bytes of each entry by step, once counted (kept up to date from then on)."""

    def _path(self, step: int) -> Path:
        return self.root / f"step-{step:09d}.safetensors"

    def write(self, step: int, batch: LoggedBatch) -> None:
        """Records step ``step``'s batch (atomically)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tensors = {"inputs": batch.inputs, "targets": batch.targets}
        tensors.update({_SIDE + name: t for name, t in batch.side.items()})
        path = self._path(step)
        save_weights(tensors, path)
        size = path.stat().st_size
        with self._lock:
            if self._sizes is not None:
                self._sizes[step] = size

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

    def entries(self) -> dict[int, Path]:
        """Every entry's file by step."""
        if not self.root.is_dir():
            return {}
        found = {}
        for path in self.root.glob("step-*.safetensors"):
            number = path.name[5:].split(".", 1)[0]
            if number.isdigit():
                found[int(number)] = path
        return found

    def size_bytes(self) -> int:
        """Bytes the entries take on disk (counted once, then kept as entries come and go)."""
        with self._lock:
            if self._sizes is None:
                self._sizes = {}
                for step, path in self.entries().items():
                    with contextlib.suppress(FileNotFoundError):  # pruned meanwhile
                        self._sizes[step] = path.stat().st_size
            return sum(self._sizes.values())

    def _remove(self, step: int, path: Path) -> None:
        path.unlink(missing_ok=True)
        with self._lock:
            if self._sizes is not None:
                self._sizes.pop(step, None)

    def prune(self, up_to_step: int) -> None:
        """Removes every entry for steps <= ``up_to_step``."""
        for step, path in self.entries().items():
            if step <= up_to_step:
                self._remove(step, path)

    def drop_after(self, step: int) -> None:
        """Removes every entry for steps > ``step`` (a lineage that loading state superseded;
        only while no entry is being written)."""
        for number, path in self.entries().items():
            if number > step:
                self._remove(number, path)
