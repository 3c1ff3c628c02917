"""Hugging Face causal LMs as pipesvc layers, read from a local checkpoint directory.

A decoder-only model of ``transformers`` has one shape whatever its family: token embeddings
(plus learned positions in GPT-2), one list of decoder blocks, a final norm and the LM head.
pipesvc cuts it there: layer 0 is the embedding, layers ``1..L`` are the blocks, layer ``L + 1``
is the final norm with the head, so any contiguous range can live on a stage. A family is a
``Family`` entry naming where those parts live in its ``transformers`` model (``FAMILIES``);
the blocks themselves are ``transformers``' own modules, so the numbers are theirs.

[Note: Hugging Face layers] Each block computes what it needs beside the hidden states on its
own stage: the positions ``0..T-1``, the rotary embeddings from them (the family's own rotary
module, rebuilt on the stage, since its frequencies are a buffer the checkpoint does not hold)
and the causal mask (``attention_mask=None`` with the ``sdpa`` attention, which is then causal).
Only the hidden states cross stages, so no padding mask is carried yet: a batch's rows all
have the same length. The model is built on the meta device from ``config.json`` (no memory),
so the planner's description costs nothing; a stage then materialises only its own layers and
reads their tensors by byte range from the safetensors files (``read_tensors``), never a
whole file. Parameters are float32 (master weights for training), whatever the checkpoint's
dtype. When the config ties the input embedding and the head (GPT-2, Gemma), the head layer
loads the embedding's tensor as its own weight; keeping the two copies equal during training,
when they sit on different stages, is not done yet.

Security: a directory is named by the operator who starts the stage (``register_hf_model``),
never by a request; ``config.json`` is read as JSON and no code from the directory is run
(``trust_remote_code`` stays off); the weight index may only name files inside the directory.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError, NotFoundError
from pipesvc.models.lora import add_lora, check_lora
from pipesvc.models.registry import LayerSpec, register_model
from pipesvc.models.rng import RNG_LOCK
from pipesvc.storage.weights import read_header, read_tensors

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
"""Largest ``config.json`` or index read (1 MiB; real ones are a few KiB to a few hundred)."""


@dataclass(frozen=True, slots=True)
class Family:
    """Where the parts of a family's ``...ForCausalLM`` live (attribute paths from the top)."""

    embed: str
    blocks: str
    norm: str
    head: str = "lm_head"
    positions: str | None = None
    """Learned position embeddings added to the token embeddings (GPT-2)."""
    dropout: str | None = None
    """Dropout after the embedding, if the family has one."""
    rotary: str | None = None
    """The rotary embedding module, called with (hidden states, position ids)."""
    stored: tuple[tuple[str, str], ...] = ()
    """(module path, older name in checkpoints): a tensor missing under the module's path is
    looked up under the older name (``transformers`` renames some parts on load)."""


def _llama_like(prefix: str = "model") -> Family:
    return Family(
        embed=f"{prefix}.embed_tokens",
        blocks=f"{prefix}.layers",
        norm=f"{prefix}.norm",
        rotary=f"{prefix}.rotary_emb",
    )


FAMILIES: dict[str, Family] = {
    "llama": _llama_like(),
    "mistral": _llama_like(),
    "qwen2": _llama_like(),
    "qwen3": _llama_like(),
    "gemma": _llama_like(),
    "olmo": _llama_like(),
    "phi": Family(
        embed="model.embed_tokens",
        blocks="model.layers",
        norm="model.final_layernorm",
        dropout="model.embed_dropout",
        rotary="model.rotary_emb",
    ),
    "gpt_neox": Family(
        embed="gpt_neox.embed_in",
        blocks="gpt_neox.layers",
        norm="gpt_neox.final_layer_norm",
        dropout="gpt_neox.emb_dropout",
        rotary="gpt_neox.rotary_emb",
        stored=(("lm_head", "embed_out"),),
    ),
    "gpt2": Family(
        embed="transformer.wte",
        positions="transformer.wpe",
        dropout="transformer.drop",
        blocks="transformer.h",
        norm="transformer.ln_f",
    ),
}
"""Supported ``model_type`` values of ``config.json``. Same-shaped families need only an entry."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise NotFoundError(f"{str(path)!r} does not exist") from None
    if size > MAX_CONFIG_BYTES:
        raise InvalidArgumentError(f"{str(path)!r} is {size} bytes; at most {MAX_CONFIG_BYTES}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{str(path)!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{str(path)!r} must hold a JSON object")
    return value


class Checkpoint:
    """A Hugging Face model directory: its config, family and where each tensor is stored."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).resolve()
        if not self.directory.is_dir():
            raise NotFoundError(f"Hugging Face model directory {str(directory)!r} does not exist")
        config = _read_json(self.directory / CONFIG_FILE)
        self.model_type = str(config.get("model_type", ""))
        family = FAMILIES.get(self.model_type)
        if family is None:
            raise InvalidArgumentError(
                f"{str(self.directory)!r}: model_type {self.model_type!r} is not supported; "
                f"expected one of {', '.join(sorted(FAMILIES))}"
            )
        self.family = family
        self.files = self._tensor_files()

    def _tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the file holding it, from the index or the single file's header."""
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InvalidArgumentError(f"{str(index)!r} has no weight_map object")
            files: dict[str, Path] = {}
            for name, file in weight_map.items():
                if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                    raise InvalidArgumentError(
                        f"{str(index)!r}: tensor {name!r} is mapped to {file!r}; expected a file "
                        "name inside the model directory"
                    )
                files[str(name)] = self.directory / file
            return files
        single = self.directory / SINGLE_FILE
        if not single.exists():
            raise NotFoundError(
                f"{str(self.directory)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}"
            )
        return {name: single for name in read_header(single)}

    @functools.cached_property
    def config(self) -> Any:
        """The ``transformers`` config, with the ``sdpa`` attention (causal without a mask)."""
        from transformers import AutoConfig  # optional dependency, imported when used

        config = AutoConfig.from_pretrained(
            str(self.directory), local_files_only=True, trust_remote_code=False
        )
        config._attn_implementation = "sdpa"
        return config

    @functools.cached_property
    def meta_model(self) -> nn.Module:
        """The whole model with its parameters on the meta device (no memory) and its buffers
        real: computed buffers that no checkpoint holds (rotary frequencies, embedding scales)
        keep their values."""
        from transformers import AutoModelForCausalLM

        with RNG_LOCK, _parameters_on_meta():
            model: nn.Module = AutoModelForCausalLM.from_config(self.config)
        return model

    def prepare(self) -> None:
        """Parses the config and builds the skeleton now (importing ``transformers`` and the
        family's modelling code), so a bad config fails at start, not at the first job."""
        _ = self.meta_model

    @property
    def num_blocks(self) -> int:
        return len(_part(self.meta_model, self.family.blocks))

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def read(self, names: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """``{local name: checkpoint name}`` -> ``{local name: tensor}``, each file read once."""
        names = {local: self._stored_name(stored) for local, stored in names.items()}
        by_file: dict[Path, list[str]] = {}
        for stored in names.values():
            by_file.setdefault(self.files[stored], []).append(stored)
        found: dict[str, torch.Tensor] = {}
        for file, stored_names in by_file.items():
            found.update(read_tensors(file, stored_names))
        return {local: found[stored] for local, stored in names.items()}

    def _stored_name(self, name: str) -> str:
        if name in self.files:
            return name
        for path, older in self.family.stored:
            if name.startswith(f"{path}.") and (alias := older + name[len(path) :]) in self.files:
                return alias
        raise NotFoundError(f"{str(self.directory)!r} holds no tensor {name!r}")


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device; buffers stay real.

    Patches ``nn.Module.register_parameter`` for the duration, so callers hold ``RNG_LOCK``
    (which serialises every layer construction in the process).
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _part(model: nn.Module, path: str) -> Any:
    part: Any = model
    for attribute in path.split("."):
        part = getattr(part, attribute)
    return part


def _call_block(block: nn.Module, hidden: torch.Tensor, rotary: nn.Module | None) -> torch.Tensor:
    params = inspect.signature(block.forward).parameters
    batch, length = hidden.shape[0], hidden.shape[1]
    positions = torch.arange(length, device=hidden.device).unsqueeze(0).expand(batch, length)
    extra: dict[str, Any] = {}
    if rotary is not None and "position_embeddings" in params:
        extra["position_embeddings"] = rotary(hidden, positions)
    if "position_ids" in params:
        extra["position_ids"] = positions
    out = block(hidden, attention_mask=None, **extra)
    result: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return result


class Embedding(nn.Module):
    """Token ids ``[B, T]`` -> hidden states ``[B, T, H]``."""

    def __init__(self, embed: nn.Module, positions: nn.Module | None, dropout: nn.Module | None):
        super().__init__()
        self.embed = embed
        self.positions = positions
        self.dropout = dropout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.embed(ids)
        if self.positions is not None:
            hidden = hidden + self.positions(torch.arange(ids.shape[1], device=ids.device))
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return hidden


class Block(nn.Module):
    """One decoder block: hidden states in and out (see [Note: Hugging Face layers])."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary  # computed buffers only: nothing stored, nothing trained

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _call_block(self.block, hidden, self.rotary)


class Head(nn.Module):
    """Final norm and LM head: hidden states -> logits ``[B, T, vocab]``."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.norm(hidden))
        return logits


def _local_to_stored(ckpt: Checkpoint, index: int, layer: nn.Module) -> dict[str, str]:
    """Each ``state_dict`` name of pipesvc layer ``index`` -> its name in the checkpoint."""
    family, last = ckpt.family, ckpt.num_blocks + 1
    parts: dict[str, str | None]
    if index == 0:
        parts = {"embed": family.embed, "positions": family.positions, "dropout": family.dropout}
    elif index == last:
        head = family.embed if ckpt.tied else family.head
        parts = {"norm": family.norm, "head": head}
    else:
        parts = {"block": f"{family.blocks}.{index - 1}"}
    names = {}
    for local in layer.state_dict():
        part, _, rest = local.partition(".")
        stored = parts[part]
        assert stored is not None, local
        names[local] = f"{stored}.{rest}"
    return names


def _rotary(ckpt: Checkpoint) -> nn.Module | None:
    path = ckpt.family.rotary
    return copy.deepcopy(_part(ckpt.meta_model, path)) if path is not None else None


def build_hf_layer(
    directory: str, index: int, lora: Mapping[str, object] | None = None
) -> nn.Module:
    """Builds layer ``index`` of the model in ``directory`` with its checkpoint tensors.

    On the meta device (describing the model) nothing is read. With ``lora`` the layer gets
    adapters and only they train (see [Note: LoRA on stages]).
    """
    ckpt = _checkpoint(directory)
    model, family, last = ckpt.meta_model, ckpt.family, ckpt.num_blocks + 1
    if not 0 <= index <= last:
        raise InvalidArgumentError(f"layer {index} is outside [0, {last}] of {directory!r}")

    def part(path: str | None) -> nn.Module | None:
        return copy.deepcopy(_part(model, path)) if path is not None else None

    layer: nn.Module
    if index == 0:
        embed = part(family.embed)
        assert embed is not None
        layer = Embedding(embed, part(family.positions), part(family.dropout))
    elif index == last:
        norm, head = part(family.norm), part(family.head)
        assert norm is not None and head is not None
        layer = Head(norm, head)
    else:
        block = part(f"{family.blocks}.{index - 1}")
        assert block is not None
        layer = Block(block, _rotary(ckpt))
    device = torch.get_default_device()
    if device.type == "meta":
        layer = layer.to("meta")
        return add_lora(layer, lora) if lora is not None else layer
    stored = ckpt.read(_local_to_stored(ckpt, index, layer))
    for name, param in list(layer.named_parameters()):
        owner, _, attribute = name.rpartition(".")
        module = layer.get_submodule(owner)
        module._parameters[attribute] = nn.Parameter(
            stored.pop(name).to(device=device, dtype=param.dtype),
            requires_grad=param.requires_grad,
        )
    layer.to(device)
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():  # persistent buffers
            if name in stored:
                tensor.copy_(stored[name])
    return add_lora(layer, lora) if lora is not None else layer


@functools.lru_cache(maxsize=16)
def _checkpoint(directory: str) -> Checkpoint:
    return Checkpoint(directory)


def hf_layer_specs(
    directory: str | os.PathLike[str], lora: Mapping[str, object] | None = None
) -> list[LayerSpec]:
    """The unbuilt layers of the model in ``directory``: embedding, blocks, norm with head;
    with LoRA adapters where ``lora`` says (peft's ``LoraConfig`` fields)."""
    where = str(Path(directory).resolve())
    ckpt = _checkpoint(where)
    if lora is not None:
        lora = check_lora(lora)
    return [LayerSpec(build_hf_layer, where, i, lora) for i in range(ckpt.num_blocks + 2)]


def register_hf_model(name: str, directory: str | os.PathLike[str]) -> None:
    """Serves the Hugging Face model in ``directory`` under ``name``; requests name only ``name``.

    The directory is checked now (config, family, weight files), so a mistake fails at start;
    ``transformers`` and the family's code are imported now too (about 200 MB of a process's
    memory, once, whatever the model's size).

    Raises:
        NotFoundError: the directory, its config or its weights do not exist.
        InvalidArgumentError: the name is invalid or taken, or the model family is unsupported.
    """
    where = str(Path(directory).resolve())
    _checkpoint(where).prepare()
    register_model(name)(_factory(where))


@functools.lru_cache(maxsize=64)
def _factory(directory: str) -> Any:
    """One factory per directory, so registering the same name and directory twice is a no-op."""

    def factory(lora: dict[str, object] | None = None) -> list[LayerSpec]:
        return hf_layer_specs(directory, lora)

    factory.__qualname__ = f"hf_model[{directory}]"
    return factory
