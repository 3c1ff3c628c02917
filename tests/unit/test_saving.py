"""Saving into a directory a user names (checkpoints, Hugging Face exports) never deletes a file
pipesvc did not write: files are written beside and moved in, only the format's own files are
overwritten, stale ones of an earlier save by pipesvc are removed, and what cannot be done
safely is refused with the path named and nothing changed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipesvc.errors import FailedPreconditionError, InvalidArgumentError
from pipesvc.models.hf_checkpoint import Checkpoint
from pipesvc.models.hf_export import write_adapter, write_model
from pipesvc.storage.checkpoint import (
    CheckpointStore,
    group_by_layer,
    read_layers,
    read_manifest,
    write_checkpoint,
)

LLAMA = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
KEYS = {"embed_key": "model.embed_tokens.weight", "head_key": "lm_head.weight"}


@pytest.fixture(scope="module")
def llama() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA))
    return model.config.to_dict(), dict(model.state_dict())


def layers(num: int, value: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    state = {f"{i}.weight": torch.full((3,), value + i) for i in range(num)}
    state.update({f"__optim__.{i}.weight.momentum_buffer": torch.zeros(3) for i in range(num)})
    return group_by_layer(state)


def info(num: int, step: int = 1) -> dict[str, Any]:
    return {"job_id": "j", "step": step, "spec": {}, "num_layers": num, "plan": []}


def user_files(directory: Path) -> dict[str, bytes]:
    """A user's own things in ``directory``: a file, a hidden file, a subdirectory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "notes.txt").write_text("mine")
    (directory / ".env").write_text("SECRET=1")
    (directory / "data").mkdir()
    (directory / "data" / "x.bin").write_bytes(b"\x00\x01")
    return snapshot(directory, only=("notes.txt", ".env", "data/x.bin"))


def snapshot(directory: Path, only: tuple[str, ...] | None = None) -> dict[str, bytes]:
    files = {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }
    return {k: v for k, v in files.items() if only is None or k in only}


def test_a_checkpoint_saved_into_a_directory_keeps_the_users_files(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    mine = user_files(target)
    write_checkpoint(target, layers(4), **info(4))
    assert snapshot(target, tuple(mine)) == mine
    manifest = read_manifest(target)
    assert dict(read_layers(target, manifest, 0, 4)).keys() == dict(layers(4)).keys()
    assert not [p for p in target.iterdir() if "pipesvc-tmp" in p.name]


def test_a_checkpoint_over_a_larger_one_leaves_no_stale_layer_files(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    mine = user_files(target)
    write_checkpoint(target, layers(5), **info(5))
    write_checkpoint(target, layers(2, value=7.0), **info(2, step=9))
    assert snapshot(target, tuple(mine)) == mine
    ours = sorted(p.name for p in target.iterdir() if p.name not in {"notes.txt", ".env", "data"})
    assert ours == ["layer-00000.safetensors", "layer-00001.safetensors", "manifest.json"]
    manifest = read_manifest(target)
    assert manifest.step == 9
    assert torch.equal(dict(read_layers(target, manifest, 0, 2))["1.weight"], torch.full((3,), 8.0))


def test_a_users_sibling_named_like_the_old_temporary_directory_survives(tmp_path: Path) -> None:
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / "keep.txt").write_text("mine")
    (tmp_path / "model.tmp").write_text("mine too")
    write_checkpoint(tmp_path / "ckpt", layers(2), **info(2))
    write_checkpoint(tmp_path / "ckpt", layers(2), **info(2))  # and over an existing one
    assert (tmp_path / "ckpt.tmp" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "model.tmp").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.tmp", "model.tmp"]


def test_saving_into_the_working_directory_writes_into_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama: Any
) -> None:
    config, state = llama
    monkeypatch.chdir(tmp_path)
    mine = user_files(tmp_path)
    write_checkpoint(".", layers(2), **info(2))
    write_model(state, config, ".", **KEYS)
    assert Path.cwd() == tmp_path and tmp_path.is_dir()
    assert snapshot(tmp_path, tuple(mine)) == mine
    assert read_manifest(tmp_path).num_layers == 2
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()


def test_an_export_keeps_the_users_files_and_replaces_a_larger_earlier_one(
    tmp_path: Path, llama: Any
) -> None:
    config, state = llama
    target = tmp_path / "out"
    mine = user_files(target)
    (target / "tokenizer.json").write_text("{}")  # a file of the model the save does not write
    write_model(state, config, target, **KEYS, max_shard_bytes=20_000)
    shards = sorted(target.glob("model-*.safetensors"))
    assert len(shards) > 2 and (target / "model.safetensors.index.json").exists()
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    write_model(changed, config, target, **KEYS, max_shard_bytes=60_000)
    fewer = sorted(target.glob("model-*.safetensors"))
    assert 1 < len(fewer) < len(shards)  # the earlier save's extra shards are gone
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in fewer]
    write_model(state, config, target, **KEYS)  # one file: the index and every shard go
    assert not list(target.glob("model-*"))
    assert not (target / "model.safetensors.index.json").exists()
    assert snapshot(target, (*mine, "tokenizer.json")) == {**mine, "tokenizer.json": b"{}"}
    loaded = AutoModelForCausalLM.from_pretrained(target)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    assert set(Checkpoint(target).files.values()) == {target.resolve() / "model.safetensors"}


def test_a_weight_file_pipesvc_did_not_write_is_never_deleted(tmp_path: Path, llama: Any) -> None:
    # transformers' own sharded save is there: saving one file over it would leave its index
    # and shards to confuse a reader, and deleting them would delete what pipesvc did not
    # write, so the save is refused, with the file named, and nothing changes.
    config, state = llama
    target = tmp_path / "out"
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA))
    model.save_pretrained(target, max_shard_size="30KB")
    (target / "notes.txt").write_text("mine")
    before = snapshot(target)
    with pytest.raises(FailedPreconditionError, match=r"holds 'model-0000\d-of-0000\d\.safet"):
        write_model(state, config, target, **KEYS)
    assert snapshot(target) == before
    assert sorted(p.name for p in target.iterdir()) == sorted(before)  # no temporary left
    # The same names are the format's own: a save of the same shape overwrites them.
    write_model(state, config, target, **KEYS, max_shard_bytes=30_000)
    assert (target / "notes.txt").read_text() == "mine"
    loaded = AutoModelForCausalLM.from_pretrained(target)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


def test_targets_that_cannot_be_saved_into_safely_are_refused(tmp_path: Path, llama: Any) -> None:
    config, state = llama
    (tmp_path / "a-file").write_text("mine")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for name in ("a-file", "dangling"):
        target = tmp_path / name
        with pytest.raises(InvalidArgumentError, match=re.escape(f"cannot save into '{target}'")):
            write_checkpoint(target, layers(1), **info(1))
        with pytest.raises(InvalidArgumentError, match=re.escape(f"cannot save into '{target}'")):
            write_model(state, config, target, **KEYS)
        with pytest.raises(InvalidArgumentError, match=re.escape(f"cannot save into '{target}'")):
            write_adapter({}, {"target_modules": ["q_proj"]}, target)
    assert (tmp_path / "a-file").read_text() == "mine"
    assert os.readlink(tmp_path / "dangling") == str(tmp_path / "nowhere")
    # A directory where the save writes a file is not overwritten either.
    (tmp_path / "out" / "config.json").mkdir(parents=True)
    with pytest.raises(FailedPreconditionError, match=r"'config\.json' into .* is not a plain"):
        write_model(state, config, tmp_path / "out", **KEYS)
    (tmp_path / "ck" / "layer-00001.safetensors").mkdir(parents=True)  # stale, not a file
    with pytest.raises(FailedPreconditionError, match=r"holds 'layer-00001\.safetensors'"):
        write_checkpoint(tmp_path / "ck", layers(1), **info(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "ck", "dangling", "out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["config.json"]
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["layer-00001.safetensors"]


def test_pruning_a_store_removes_its_interrupted_writes_only(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    for step in (1, 2):
        write_checkpoint(store.path(step), layers(1), **info(1, step))
    interrupted = tmp_path / ".step-000000003.0123456789abcdef.pipesvc-tmp"
    interrupted.mkdir()
    (tmp_path / ".step-000000003.tmp").mkdir()  # not a name pipesvc makes
    store.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-000000003.tmp", "step-000000002"]
