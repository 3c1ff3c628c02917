"""Hugging Face causal LMs as pipesvc layers, read from a local checkpoint directory.

A decoder-only model of ``transformers`` has one shape whatever its family: token embeddings
(plus learned positions in GPT-2), one list of decoder blocks, a final norm and the LM head.
pipesvc cuts it there: layer 0 is the embedding, layers ``1..L`` are the blocks, layer ``L + 1``
is the final norm with the head, so any contiguous range can live on a stage. A family is a
``Family`` entry naming where those parts live in its ``transformers`` model (``FAMILIES``);
the blocks themselves are ``transformers``' own modules, so the numbers are theirs.

[Note: Hugging Face layers] Each block computes what it needs beside the hidden states on its
own stage: the positions ``0..T-1``, the rotary embeddings from them (the family's own rotary
module, whose frequencies are computed buffers no checkpoint holds: the skeleton keeps buffers
real and only parameters on the meta device) and the attention mask, which ``transformers``'
own mask builders make from the causal rule (a sliding window where the config has one) and
the batch's padding ``attention_mask``. That mask is a side input: every stage gets it with the
run request (see [Note: side inputs] in ``pipesvc.core.microbatch``); only the hidden states
cross from stage to stage. The model is built on the meta device from ``config.json`` (no memory),
so the planner's description costs nothing; a stage then materialises only its own layers and
reads their tensors by byte range from the safetensors files (``read_tensors``), never a
whole file. Parameters are float32 (master weights for training), whatever the checkpoint's
dtype (see [Note: stored dtype] in ``hf_checkpoint.py``). When the config ties the input
embedding and the head (GPT-2, Gemma), the head layer loads the embedding's tensor as its own
weight, and the two copies are declared tied
(``tied_keys``): every training run gives both the sum of their gradients, so they stay equal
wherever they sit (see [Note: tied parameters] in ``pipesvc.core.tying``). The directory is
read by ``Checkpoint`` (``hf_checkpoint.py``), the family table is ``hf_family.py``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.hf_checkpoint import Checkpoint, part_of
from pipesvc.models.lora import add_lora, check_lora
from pipesvc.models.registry import CacheLayout, CacheTensors, LayerSpec, register_model


@functools.lru_cache(maxsize=4)
def _mask_functions() -> tuple[Any, Any, frozenset[str]]:
    """transformers' causal and sliding-window mask builders and their parameter names (the
    cache argument is ``cache`` in 5.x, ``past_key_values`` with ``cache_position`` before)."""
    from transformers import masking_utils

    causal = masking_utils.create_causal_mask
    sliding = masking_utils.create_sliding_window_causal_mask
    return causal, sliding, frozenset(inspect.signature(causal).parameters)


def _attention_mask(
    config: Any,
    block_index: int,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    padding: torch.Tensor | None,
    cache: Any,
) -> torch.Tensor | None:
    """Block ``block_index``'s attention mask, built as the family's own model builds it: the
    causal mask (sliding-window where the config says so) with the ``padding`` mask, over the
    ``cache``'s past positions and the new ones; None where plain causal attention computes the
    same (no padding and no past, the ``sdpa`` path). Built before the block adds the new keys
    to its cache, from that block's own cache layer (a stage holds only some of them)."""
    causal, sliding, params = _mask_functions()
    types = getattr(config, "layer_types", None)
    if types:
        window = types[block_index] == "sliding_attention"
    else:
        window = getattr(config, "sliding_window", None) is not None
    if padding is None and cache is None and (not window or hidden.is_meta):
        return None  # causal: sdpa's own causal path (and a description on meta is sizes only)
    kwargs: dict[str, Any] = {
        "config": config,
        "inputs_embeds": hidden,
        "attention_mask": padding,
        "position_ids": positions,
    }
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    if "layer_idx" in params:
        kwargs["layer_idx"] = block_index
    if "cache_position" in params:
        past = cache.get_seq_length(block_index) if cache is not None else 0
        kwargs["cache_position"] = torch.arange(past, past + hidden.shape[1], device=hidden.device)
    mask: torch.Tensor | None = (sliding if window else causal)(**kwargs)
    return mask


def _call_block(
    block: nn.Module,
    hidden: torch.Tensor,
    rotary: nn.Module | None,
    where: tuple[Any, int],
    padding: torch.Tensor | None,
    positions: torch.Tensor | None,
    cache: Any,
) -> torch.Tensor:
    params = inspect.signature(block.forward).parameters
    batch, length = hidden.shape[0], hidden.shape[1]
    if positions is None:  # training and plain forward: 0..T-1, as transformers' model uses
        positions = torch.arange(length, device=hidden.device).unsqueeze(0)
    positions = positions.to(hidden.device)
    extra: dict[str, Any] = {}
    if rotary is not None and "position_embeddings" in params:
        extra["position_embeddings"] = rotary(hidden, positions.expand(batch, length))
    if "position_ids" in params:
        extra["position_ids"] = positions.expand(batch, length)
    config, index = where
    attention = _attention_mask(config, index, hidden, positions, padding, cache)
    if cache is not None:
        extra["cache" if "cache" in params else "past_key_values"] = cache
        extra["use_cache"] = True
        if "cache_position" in params:
            past = cache.get_seq_length(index)
            extra["cache_position"] = torch.arange(past, past + length, device=hidden.device)
    out = block(hidden, attention_mask=attention, **extra)
    result: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return result


class Embedding(nn.Module):
    """Token ids ``[B, T]`` -> hidden states ``[B, T, H]``."""

    def __init__(self, embed: nn.Module, positions: nn.Module | None, dropout: nn.Module | None):
        super().__init__()
        self.embed = embed
        self.positions = positions
        self.dropout = dropout

    side_inputs = ("position_ids",)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden: torch.Tensor = self.embed(ids)
        if self.positions is not None:
            if position_ids is None:
                position_ids = torch.arange(ids.shape[1], device=ids.device)
            hidden = hidden + self.positions(position_ids.to(ids.device))
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return hidden


class Block(nn.Module):
    """One decoder block: hidden states in and out, with the batch's padding mask as a side
    input (see [Note: Hugging Face layers])."""

    side_inputs = ("attention_mask", "position_ids")
    uses_cache = True

    def __init__(self, block: nn.Module, rotary: nn.Module | None, config: Any, index: int) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary  # computed buffers only: nothing stored, nothing trained
        self.config = config  # read by the mask builders only
        self.index = index

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """``attention_mask`` covers the cached positions and the new ones (``[B, past + T]``),
        ``position_ids`` the new ones (``[B, T]``); ``cache`` (a ``transformers`` cache) holds
        the keys and values of earlier positions and takes this call's."""
        past = cache.get_seq_length(self.index) if cache is not None else 0
        expected = (hidden.shape[0], past + hidden.shape[1])
        if attention_mask is not None and tuple(attention_mask.shape) != expected:
            raise InvalidArgumentError(
                f"attention_mask of shape {list(attention_mask.shape)} for hidden states of "
                f"shape {list(hidden.shape)} after {past} cached positions; expected "
                f"{list(expected)}"
            )
        where = (self.config, self.index)
        return _call_block(
            self.block, hidden, self.rotary, where, attention_mask, position_ids, cache
        )


class Head(nn.Module):
    """Final norm and LM head: hidden states -> logits ``[B, T, vocab]``."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.norm(hidden))
        return logits


def stored_names(
    ckpt: Checkpoint, index: int, layer: nn.Module, *, reading: bool = True
) -> dict[str, str]:
    """Each ``state_dict`` name of pipesvc layer ``index`` -> the model's own name for it.

    ``reading``: the name to read from the checkpoint, where a tied head is the embedding's
    tensor; otherwise the name in the model's ``state_dict()``, where the head has its own.
    """
    family, last = ckpt.family, ckpt.num_blocks + 1
    parts: dict[str, str | None]
    if index == 0:
        parts = {"embed": family.embed, "positions": family.positions, "dropout": family.dropout}
    elif index == last:
        head = family.embed if ckpt.tied and reading else family.head
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


def export_info(
    directory: str | os.PathLike[str], lora: Mapping[str, object] | None = None
) -> dict[str, object]:
    """What a client needs to write the model as a Hugging Face directory: the original
    ``config.json``, the dtype the model is stored in, the key map (``model_keys``), the tied
    tensors' keys and the LoRA arguments (see ``pipesvc.models.hf_export``)."""
    where = str(Path(directory).resolve())
    ckpt = _checkpoint(where)
    return {
        "format": "huggingface",
        "source": where,
        "config": ckpt.raw_config,
        "dtype": ckpt.stored_dtype,
        "keys": model_keys(where, lora),
        "embed_key": f"{ckpt.family.embed}.weight",
        "head_key": f"{ckpt.family.head}.weight",
        "lora": dict(lora) if lora is not None else None,
    }


def model_keys(
    directory: str | os.PathLike[str], lora: Mapping[str, object] | None = None
) -> dict[str, str]:
    """Every ``"{layer}.{name}"`` key of the pipesvc model -> the key of the Hugging Face
    model's own ``state_dict()`` (LoRA adapters under peft's names); builds on meta only."""
    where = str(Path(directory).resolve())
    ckpt = _checkpoint(where)
    keys = {}
    with torch.device("meta"):
        for index, spec in enumerate(hf_layer_specs(where, lora)):
            layer = spec.build()
            for local, name in stored_names(ckpt, index, layer, reading=False).items():
                keys[f"{index}.{local}"] = name
    return keys


def make_cache(directory: str) -> Any:
    """An empty ``transformers`` key/value cache for the model in ``directory`` (sliding-window
    layers keep only their window), for one generation session's part on one stage."""
    return _cache_maker(directory)()


@functools.lru_cache(maxsize=16)
def _cache_maker(directory: str) -> Any:
    """The function ``make_cache`` calls for the model in ``directory``, chosen once (a stage
    makes one per session part and step, and reading the config is not cheap)."""
    from transformers import DynamicCache

    config = _checkpoint(directory).meta_model.config
    if _full_attention_only(config):
        return DynamicCache  # plain layers, added as blocks use them (and cheap to make)
    try:
        DynamicCache(config=config)
    except TypeError:  # transformers before the config argument
        return DynamicCache
    return functools.partial(DynamicCache, config=config)


def _full_attention_only(config: Any) -> bool:
    """Every block attends to every earlier position (no sliding window, no chunks)."""
    types = getattr(config, "layer_types", None) or ()
    return getattr(config, "sliding_window", None) is None and all(
        t == "full_attention" for t in types
    )


def _cache_tensors(cache: Any) -> CacheTensors:
    """The keys and values of each layer a ``transformers`` cache holds (a stage's cache holds
    only its own blocks')."""
    tensors: CacheTensors = {}
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.numel():
            tensors[index] = (keys, values)
    return tensors


def _cache_from_tensors(directory: str, tensors: CacheTensors) -> Any:
    """A cache holding ``tensors`` themselves (no copy: its layers keep these tensors, which may
    be views of a stacked cache, until their next append makes new ones)."""
    cache = make_cache(directory)
    for index, (keys, values) in tensors.items():
        if not isinstance(index, int):
            raise InvalidArgumentError(f"cache layer {index!r}: expected a block index")
        cache.update(keys[:, :, :0], values[:, :, :0], index)  # the layer, empty
        layer = cache.layers[index]
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            layer.keys, layer.values = keys, values
        else:  # a cache layer of another shape: its own append (a copy)
            cache.update(keys, values, index)
    return cache


def cache_layout(directory: str) -> CacheLayout | None:
    """How several sessions' caches of the model in ``directory`` stack into one batch (see
    [Note: fused decode] in ``pipesvc.stage.fused_cache``); None for a model with sliding-window
    layers (a window's cache drops old positions, so rows of different lengths do not line up)
    and for a ``transformers`` whose caches keep no per-layer objects."""
    from transformers import DynamicCache

    if not _full_attention_only(_checkpoint(directory).meta_model.config):
        return None
    if not hasattr(DynamicCache(), "layers"):
        return None
    return CacheLayout(
        tensors=_cache_tensors, build=functools.partial(_cache_from_tensors, directory)
    )


def tied_keys(directory: str | os.PathLike[str]) -> list[tuple[str, ...]]:
    """The tied groups of the model in ``directory``: the input embedding and the head when
    its config ties them (see [Note: tied parameters] in ``pipesvc.core.tying``)."""
    ckpt = _checkpoint(str(Path(directory).resolve()))
    if not ckpt.tied:
        return []
    return [("0.embed.weight", f"{ckpt.num_blocks + 1}.head.weight")]


def _rotary(ckpt: Checkpoint) -> nn.Module | None:
    path = ckpt.family.rotary
    return copy.deepcopy(part_of(ckpt.meta_model, path)) if path is not None else None


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
        return copy.deepcopy(part_of(model, path)) if path is not None else None

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
        layer = Block(block, _rotary(ckpt), model.config, index - 1)
    device = torch.get_default_device()
    if device.type == "meta":
        layer = layer.to("meta")
        return add_lora(layer, lora) if lora is not None else layer
    stored = ckpt.read(stored_names(ckpt, index, layer))
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

    def export(lora: dict[str, object] | None = None) -> dict[str, object]:
        return export_info(directory, lora)

    def tied(lora: dict[str, object] | None = None) -> list[tuple[str, ...]]:
        return tied_keys(directory)

    def new_cache(lora: dict[str, object] | None = None) -> Any:
        return functools.partial(make_cache, directory)

    def layout(lora: dict[str, object] | None = None) -> CacheLayout | None:
        return cache_layout(directory)

    def max_positions(lora: dict[str, object] | None = None) -> int | None:
        # The config's limit (gpt2's n_positions answers to this name too); a family
        # without one has none.
        limit = getattr(_checkpoint(directory).meta_model.config, "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    factory.export = export  # type: ignore[attr-defined]
    factory.tied = tied  # type: ignore[attr-defined]
    factory.side_inputs = ("attention_mask", "position_ids")  # type: ignore[attr-defined]
    factory.new_cache = new_cache  # type: ignore[attr-defined]
    factory.cache_layout = layout  # type: ignore[attr-defined]
    factory.max_positions = max_positions  # type: ignore[attr-defined]

    factory.__qualname__ = f"hf_model[{directory}]"
    return factory
