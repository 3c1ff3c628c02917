"""Checkpoint coverage: a checkpoint covers every layer of the model, with or without tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pipesvc import models
from pipesvc.errors import InvalidArgumentError
from pipesvc.storage.checkpoint import (
    MANIFEST,
    group_by_layer,
    read_layers,
    read_manifest,
    verify,
    write_checkpoint,
)
from pipesvc.storage.publish import temp_name_pattern


def _info(num_layers: int) -> dict[str, Any]:
    return {"job_id": "j", "step": 3, "spec": {}, "num_layers": num_layers, "plan": []}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("cnn", {"in_channels": 1, "image_size": 8, "num_classes": 5, "channels": [3, 4]}),
        ("mlp", {"in_features": 3, "hidden_features": 4, "out_features": 2, "num_layers": 3}),
    ],
)
def test_a_model_round_trips_through_a_checkpoint(
    tmp_path: Path, name: str, args: dict[str, Any]
) -> None:
    model = models.build(name, seed=1, **args)
    state = _state(model)
    num_layers = len(model)
    written = write_checkpoint(tmp_path / "c", group_by_layer(state), **_info(num_layers))
    manifest = read_manifest(tmp_path / "c")
    assert manifest == written
    assert manifest.covers == range(num_layers)
    verify(tmp_path / "c", manifest)
    loaded = dict(read_layers(tmp_path / "c", manifest, 0, num_layers))
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


def test_parameter_free_layers_are_covered_without_files(tmp_path: Path) -> None:
    # Linear, ReLU, Linear, ReLU, Linear: layers 1 and 3 have no tensors.
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4),
        torch.nn.ReLU(),
        torch.nn.Linear(4, 4),
        torch.nn.ReLU(),
        torch.nn.Linear(4, 2),
    )
    state = _state(model)
    state["__optim__.2.weight.momentum_buffer"] = torch.ones(4, 4)
    write_checkpoint(tmp_path / "c", group_by_layer(state), **_info(5))
    raw = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert raw["covers"] == {"start_layer": 0, "end_layer": 5}
    assert sorted(raw["files"]) == ["0", "2", "4"]
    manifest = read_manifest(tmp_path / "c")
    assert dict(read_layers(tmp_path / "c", manifest, 1, 2)) == {}  # a ReLU: nothing to load
    assert dict(read_layers(tmp_path / "c", manifest, 0, 5)).keys() == state.keys()


def test_a_model_without_any_tensors_checkpoints(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "c", [], **_info(2))
    manifest = read_manifest(tmp_path / "c")
    assert manifest.files == {} and manifest.covers == range(2)


def test_tensors_of_layers_beyond_the_model_are_refused(tmp_path: Path) -> None:
    tensors = [("0.weight", torch.ones(2)), ("3.weight", torch.ones(2))]
    with pytest.raises(InvalidArgumentError, match=r"layers \[3\]; the model has 2"):
        write_checkpoint(tmp_path / "c", tensors, **_info(2))
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary directory


def test_a_key_sent_twice_is_refused(tmp_path: Path) -> None:
    tensors = [("0.weight", torch.ones(2)), ("0.weight", torch.ones(2))]
    with pytest.raises(InvalidArgumentError, match="arrived twice"):
        write_checkpoint(tmp_path / "c", tensors, **_info(1))


def _rewrite(directory: Path, **changes: Any) -> None:
    raw = json.loads((directory / MANIFEST).read_text())
    raw.update(changes)
    (directory / MANIFEST).write_text(json.dumps(raw))


def test_a_manifest_that_covers_part_of_the_model_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "c", [("0.w", torch.ones(1))], **_info(3))
    _rewrite(tmp_path / "c", covers={"start_layer": 0, "end_layer": 2})
    with pytest.raises(InvalidArgumentError, match=r"covers layers \(0, 2\); expected all"):
        read_manifest(tmp_path / "c")
    _rewrite(tmp_path / "c", covers=None)
    with pytest.raises(InvalidArgumentError, match="'covers' is malformed"):
        read_manifest(tmp_path / "c")


def test_a_manifest_listing_a_file_outside_its_layers_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "c", [("0.w", torch.ones(1))], **_info(2))
    raw = json.loads((tmp_path / "c" / MANIFEST).read_text())
    _rewrite(tmp_path / "c", files={**raw["files"], "5": raw["files"]["0"]})
    with pytest.raises(InvalidArgumentError, match=r"files of layers \[5\], outside \[0, 2\)"):
        read_manifest(tmp_path / "c")


def test_format_1_manifests_still_load(tmp_path: Path) -> None:
    tensors = [("0.w", torch.ones(1)), ("1.w", torch.zeros(2))]
    write_checkpoint(tmp_path / "c", tensors, **_info(2))
    raw = json.loads((tmp_path / "c" / MANIFEST).read_text())
    del raw["covers"]
    raw["format"] = 1
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(raw))
    manifest = read_manifest(tmp_path / "c")
    assert dict(read_layers(tmp_path / "c", manifest, 0, 2)).keys() == {"0.w", "1.w"}
    # Format 1 had one file per layer: one missing means the checkpoint is incomplete.
    raw["files"].pop("1")
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(InvalidArgumentError, match="covers layers None"):
        read_manifest(tmp_path / "c")


def test_reading_layers_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path / "c", [("0.w", torch.ones(1))], **_info(2))
    with pytest.raises(InvalidArgumentError, match=r"\[1, 3\) are not within"):
        list(read_layers(tmp_path / "c", manifest, 1, 3))


def test_a_checkpoint_is_durable_before_and_after_it_becomes_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer file, the manifest and the temporary directory reach the disk before the
    rename, and the rename itself (the parent directory) after it, since the coordinator
    prunes the step log as soon as the checkpoint is written; each layer file is synced once
    (by the publish, not also as it is written), and the temporary directory once, not once
    per layer."""
    synced: list[str] = []
    real_fsync, real_open = os.fsync, os.open
    names: dict[int, str] = {}

    def opening(path: str, flags: int, *args: Any) -> int:
        fd = real_open(path, flags, *args)
        names[fd] = os.path.abspath(path)
        return fd

    def fsync(fd: int) -> None:
        synced.append(names.get(fd, "?"))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "fsync", fsync)
    model = models.build("mlp", seed=1, in_features=3, hidden_features=4, out_features=2)
    target = tmp_path / "ckpt"
    write_checkpoint(target, group_by_layer(_state(model)), **_info(len(model)))
    temps = {s for s in synced if temp_name_pattern("ckpt").fullmatch(os.path.basename(s))}
    assert len(temps) == 1  # written beside the target, under a name of its own
    temp = temps.pop()
    layer_files = [s for s in synced if s.startswith(temp + "/layer-")]
    assert sorted(layer_files) == sorted(set(layer_files)) and len(layer_files) == len(model)
    assert not [s for s in synced if s.startswith(temp + "/.layer-")]  # once each, by publish
    assert synced.count(temp) == 1  # one directory sync for every layer file
    assert f"{temp}/{MANIFEST}" in synced
    assert synced.index(f"{temp}/{MANIFEST}") < synced.index(temp)
    assert synced[-1] == str(tmp_path)  # the rename into place, last
