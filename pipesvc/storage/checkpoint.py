"""Checkpoints on disk: one safetensors file per layer that has tensors, plus a JSON manifest
(no gRPC here).

[Note: plan-independent checkpoints] Files are per layer, not per stage, so a checkpoint loads
under any plan: each stage reads the files of its own layers. A layer file holds the layer's
state_dict entries ("{layer}.{param}") and its optimizer state
("__optim__.{layer}.{param}.{slot}"). The manifest lists each file with its SHA-256, and a
checkpoint directory appears only once complete (written under a temporary name, then renamed;
into an existing directory the manifest goes last, and only pipesvc's own files are replaced:
[Note: saving beside] in ``pipesvc.storage.publish``).

[Note: checkpoint coverage] A checkpoint covers whole models: the manifest states the layers it
covers ("covers": [0, num_layers)), and coverage is checked against the model's layer count, never
inferred from which layers have files. A layer without tensors (a Flatten, a ReLU) is covered
but has no file, so "files" may skip it; every file's layer lies in the covered range. Whether
each layer with tensors sent them all is checked by whoever knows the model (the coordinator
compares the keys against the model's description before it keeps a checkpoint; a load refuses
a state with missing keys). Format 1 manifests, which had a file for every layer, still load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipesvc.errors import InvalidArgumentError, NotFoundError
from pipesvc.storage.publish import WRITER, Staging, temp_name_pattern
from pipesvc.storage.weights import load_weights, save_weights

FORMAT = 2
READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
OPTIM_PREFIX = "__optim__."
"""Prefix of optimizer-state keys: ``__optim__.{layer}.{param}.{slot}``."""
FILES = re.compile(r"manifest\.json|layer-\d{5,}\.safetensors")
"""The files of a checkpoint directory (see [Note: saving beside])."""


def layer_of(name: str) -> int:
    """The layer index a checkpoint key belongs to.

    Raises:
        InvalidArgumentError: the key does not start with a layer index.
    """
    text = name[len(OPTIM_PREFIX) :] if name.startswith(OPTIM_PREFIX) else name
    head = text.split(".", 1)[0]
    if not (head.isascii() and head.isdigit()):
        raise InvalidArgumentError(f"checkpoint key {name!r} does not start with a layer index")
    return int(head)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """What a checkpoint directory holds."""

    job_id: str
    """The job it was taken from."""
    step: int
    """Committed steps it contains."""
    spec: dict[str, Any]
    """The job's configuration (model, arguments, seed, optimizer, ...)."""
    num_layers: int
    """Layers of the model; the checkpoint covers all of them (see [Note: checkpoint coverage])."""
    plan: list[dict[str, Any]]
    """The plan at the time (for information; loading does not need it)."""
    files: dict[int, dict[str, str]]
    """Layer index -> {"file": name, "sha256": hex digest}, for each layer that has tensors."""

    @property
    def covers(self) -> range:
        """The layers the checkpoint covers: every layer of the model."""
        return range(self.num_layers)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "job_id": self.job_id,
                "step": self.step,
                "spec": self.spec,
                "num_layers": self.num_layers,
                "covers": {"start_layer": self.covers.start, "end_layer": self.covers.stop},
                "plan": self.plan,
                "files": {str(k): v for k, v in sorted(self.files.items())},
                "created_unix_s": round(time.time(), 3),
            },
            indent=1,
        )


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The manifest of a checkpoint directory, checked for shape and completeness.

    Raises:
        NotFoundError: no checkpoint there.
        InvalidArgumentError: the manifest is malformed or lists a missing layer.
    """
    path = Path(directory) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFoundError(f"no checkpoint at {str(directory)!r} (no {MANIFEST})") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(
            f"checkpoint manifest {str(path)!r} is unreadable: {exc}"
        ) from exc
    try:
        if raw["format"] not in READABLE_FORMATS:
            raise InvalidArgumentError(
                f"checkpoint format {raw['format']!r}; expected one of {READABLE_FORMATS}"
            )
        files = {
            int(k): {"file": str(v["file"]), "sha256": str(v["sha256"])}
            for k, v in raw["files"].items()
        }
        manifest = Manifest(
            job_id=str(raw["job_id"]),
            step=int(raw["step"]),
            spec=dict(raw["spec"]),
            num_layers=int(raw["num_layers"]),
            plan=list(raw["plan"]),
            files=files,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgumentError(
            f"checkpoint manifest {str(path)!r} is malformed: {exc}"
        ) from exc
    _check_coverage(str(directory), raw, manifest)
    for entry in files.values():
        if "/" in entry["file"] or entry["file"].startswith("."):
            raise InvalidArgumentError(f"checkpoint file name {entry['file']!r} is not plain")
    return manifest


def _check_coverage(directory: str, raw: dict[str, Any], manifest: Manifest) -> None:
    """The manifest covers every layer of the model and lists files only of covered layers
    (see [Note: checkpoint coverage]).

    Raises:
        InvalidArgumentError: it covers fewer or other layers, or lists a file outside them.
    """
    if manifest.num_layers < 1:
        raise InvalidArgumentError(
            f"checkpoint {directory!r} has num_layers {manifest.num_layers}; expected >= 1"
        )
    if raw["format"] == 1:
        # Format 1 wrote a file for every layer; that was its only statement of coverage.
        covers = (
            (0, manifest.num_layers) if sorted(manifest.files) == list(manifest.covers) else None
        )
    else:
        try:
            covers = (int(raw["covers"]["start_layer"]), int(raw["covers"]["end_layer"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"checkpoint {directory!r}: 'covers' is malformed: {exc}"
            ) from exc
    if covers != (0, manifest.num_layers):
        raise InvalidArgumentError(
            f"checkpoint {directory!r} covers layers {covers}; expected all of "
            f"[0, {manifest.num_layers})"
        )
    outside = sorted(set(manifest.files) - set(manifest.covers))
    if outside:
        raise InvalidArgumentError(
            f"checkpoint {directory!r} lists files of layers {outside[:10]}, outside "
            f"[0, {manifest.num_layers})"
        )


class CheckpointWriter:
    """Writes a checkpoint from tensors that arrive grouped by layer, one layer in memory.

    Raises:
        InvalidArgumentError: ``directory`` exists and is not a directory.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._staging = Staging(directory, owned=FILES, last=(MANIFEST,))
        self._tmp = self._staging.path
        self._files: dict[int, dict[str, str]] = {}
        self._layer: int | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self.keys: set[str] = set()
        """Every key added so far (for a caller that checks completeness against its model)."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Adds one tensor; a tensor of a new layer writes out the previous layer."""
        layer = layer_of(name)
        if layer != self._layer:
            self._flush()
            if layer in self._files:
                raise InvalidArgumentError(f"layer {layer} arrived twice in a checkpoint stream")
            self._layer = layer
        if name in self.keys:
            raise InvalidArgumentError(f"checkpoint key {name!r} arrived twice")
        self.keys.add(name)
        self._tensors[name] = tensor

    def _flush(self) -> None:
        if self._layer is None:
            return
        name = f"layer-{self._layer:05d}.safetensors"
        save_weights(self._tensors, self._tmp / name, metadata=WRITER, flush=False)
        self._files[self._layer] = {"file": name, "sha256": _sha256(self._tmp / name)}
        self._tensors = {}
        self._layer = None

    def finish(
        self,
        *,
        job_id: str,
        step: int,
        spec: dict[str, Any],
        num_layers: int,
        plan: list[dict[str, Any]],
    ) -> Manifest:
        """Writes the manifest and makes the checkpoint visible (atomic rename).

        The checkpoint covers all ``num_layers`` layers; layers that sent no tensors (they have
        none) get no file (see [Note: checkpoint coverage]).

        Raises:
            InvalidArgumentError: ``num_layers`` is not positive, or a tensor's layer is not
                below it.
            FailedPreconditionError: the directory holds layer files that pipesvc did not write
                and this checkpoint would leave stale (see [Note: saving beside]).
        """
        self._flush()
        if num_layers < 1:
            raise InvalidArgumentError(f"num_layers ({num_layers}) must be at least 1")
        outside = sorted(layer for layer in self._files if layer >= num_layers)
        if outside:
            raise InvalidArgumentError(
                f"checkpoint has tensors of layers {outside[:10]}; the model has {num_layers}"
            )
        manifest = Manifest(
            job_id=job_id, step=step, spec=spec, num_layers=num_layers, plan=plan, files=self._files
        )
        (self._tmp / MANIFEST).write_text(manifest.to_json())
        # Durable before visible, and visible durably before the caller prunes the step log
        # behind it: publishing syncs every file and the directory (once for all layers),
        # then the rename or the moves.
        self._staging.publish()
        return manifest

    def discard(self) -> None:
        """Removes the partial checkpoint (its temporary directory)."""
        self._staging.discard()


def write_checkpoint(
    directory: str | os.PathLike[str], tensors: Iterable[tuple[str, torch.Tensor]], **info: Any
) -> Manifest:
    """Writes ``tensors`` (grouped by layer) as a checkpoint; see CheckpointWriter.finish."""
    writer = CheckpointWriter(directory)
    try:
        for name, tensor in tensors:
            writer.add(name, tensor)
        return writer.finish(**info)
    except BaseException:
        writer.discard()
        raise


def verify(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    """Checks every layer file of a checkpoint against its SHA-256.

    Raises:
        NotFoundError: a file is missing.
        InvalidArgumentError: a file's digest does not match.
    """
    for entry in manifest.files.values():
        path = Path(directory) / entry["file"]
        if not path.exists():
            raise NotFoundError(f"checkpoint file {str(path)!r} is missing")
        if _sha256(path) != entry["sha256"]:
            raise InvalidArgumentError(f"checkpoint file {str(path)!r} fails its SHA-256 check")


def read_layers(
    directory: str | os.PathLike[str],
    manifest: Manifest,
    start: int,
    end: int,
    *,
    check_digests: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of layers [start, end), each file checked against its digest first
    (unless ``verify`` already did). Layers without tensors have no file and yield nothing.

    Raises:
        InvalidArgumentError: [start, end) is not within the covered layers, a file's digest
            does not match, or it holds keys of other layers.
    """
    if not 0 <= start <= end <= manifest.num_layers:
        raise InvalidArgumentError(
            f"layers [{start}, {end}) are not within the checkpoint's [0, {manifest.num_layers})"
        )
    for layer in range(start, end):
        entry = manifest.files.get(layer)
        if entry is None:
            continue
        path = Path(directory) / entry["file"]
        if check_digests and _sha256(path) != entry["sha256"]:
            raise InvalidArgumentError(f"checkpoint file {str(path)!r} fails its SHA-256 check")
        for name, tensor in load_weights(path).items():
            if layer_of(name) != layer:
                raise InvalidArgumentError(f"{str(path)!r} holds {name!r}, not of layer {layer}")
            yield name, tensor


_PARTIAL = temp_name_pattern(r"step-\d{9}")
"""A checkpoint of a store, not yet published."""


class CheckpointStore:
    """A job's checkpoints under one directory: ``step-{N:09d}/``, keeping the newest few."""

    def __init__(self, root: str | os.PathLike[str], keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:09d}"

    def steps(self) -> list[int]:
        """Steps of complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(
            int(p.name[5:])
            for p in self.root.iterdir()
            if p.name.startswith("step-") and p.name[5:].isdigit() and (p / MANIFEST).exists()
        )

    def prune(self, current: int | None = None) -> None:
        """Removes all but the newest ``keep`` checkpoints up to ``current`` (the one the job
        restores; None: the newest), every one after it (a lineage that loading an older
        state superseded), so that pruning never removes the one the job points at, and the
        temporary directories of writes a crash cut short."""
        steps = self.steps()
        if current is not None:
            for step in steps:
                if step > current:
                    shutil.rmtree(self.path(step), ignore_errors=True)
            steps = [s for s in steps if s <= current]
        for step in steps[: -self.keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)
        for path in self.root.iterdir() if self.root.is_dir() else ():
            if _PARTIAL.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)


def group_by_layer(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint entries ordered by layer (weights, then optimizer state, within a layer)."""
    return sorted(tensors.items(), key=lambda kv: (layer_of(kv[0]), kv[0].startswith(OPTIM_PREFIX)))
