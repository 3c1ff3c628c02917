"""Hugging Face causal LMs as pipesvc layers, read from a local checkpoint directory.

A decoder-only model of ``transformers`` has one shape whatever its family: a body of token
embeddings (plus learned positions in GPT-2), one list of decoder blocks and a final norm, then
the LM head. pipesvc cuts it there: layer 0 is the embedding, layers ``1..L`` are the blocks,
layer ``L + 1`` is the final norm with the head, so any contiguous range can live on a stage.
Where those parts are is found from the model's structure (``hf_family.find_family``); the
blocks themselves are ``transformers``' own modules, so the numbers are theirs.

[Note: Hugging Face layers] Each block computes what it needs beside the hidden states on its
own stage, by running the body's own code up to its call (see [Note: the body's own code] in
``hf_body.py``): positions, rotary embeddings (the family's own rotary modules, whose
frequencies are computed buffers no checkpoint holds: the skeleton keeps buffers real and only
parameters on the meta device) and the attention masks, which the body builds from the causal
rule, sliding windows or chunks where the config has them, and the batch's padding
``attention_mask``. That mask is a side input: every stage gets it with the run request (see
[Note: side inputs] in ``pipesvc.core.microbatch``); only the hidden states cross from stage to
stage. The model is built on the meta device from ``config.json`` (no memory), so the planner's
description costs nothing; a stage then materialises only its own layers and reads their
tensors by byte range from the safetensors files (``read_tensors``), never a whole file, in
the layout the files use (see [Note: stored layouts] in ``hf_convert.py``). Parameters are
float32 (master weights for training), whatever the checkpoint's dtype (see [Note: stored
dtype] in ``hf_checkpoint.py``). When the config ties the input embedding and the head (GPT-2,
Gemma), the head layer loads the embedding's tensor as its own weight, and the two copies are
declared tied (``tied_keys``): every training run gives both the sum of their gradients, so
they stay equal wherever they sit (see [Note: tied parameters] in ``pipesvc.core.tying``). The
directory is read by ``Checkpoint`` (``hf_checkpoint.py``); the meta-device model that the
layers' shells copy is its ``Skeleton`` (``hf_skeleton.py``).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models import hf_body, hf_prologue
from pipesvc.models.carry import Carry, CarrySpec
from pipesvc.models.hf_cache import cache_layout, make_cache
from pipesvc.models.hf_checkpoint import MODELS_KEPT, Checkpoint, checkpoint_of, part_of
from pipesvc.models.hf_router import RouterLoss, RouterTap, router_loss_of
from pipesvc.models.hf_skeleton import Skeleton, skeleton_of
from pipesvc.models.lora import add_lora, check_lora
from pipesvc.models.registry import CacheLayout, LayerSpec, register_model


def _positions(length: int, past: int, device: torch.device) -> torch.Tensor:
    return torch.arange(past, past + length, device=device).unsqueeze(0)


def _cache_view(cache: Any, index: int) -> Any:
    """``cache`` as block ``index``'s part of the body sees it: every layer of the same kind
    answers with block ``index``'s own layer (a stage's cache holds only its own blocks', and
    the body sizes each kind's mask from one layer of that kind); updates still land in the
    real layers, which the view shares."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    grow = getattr(cache, "layer_class_to_replicate", None)
    while grow is not None and len(layers) <= index:
        layers.append(grow())  # made now, so the view and the cache hold the same object
    if index >= len(layers):
        return cache
    own = layers[index]
    view = copy.copy(cache)
    view.layers = [own if type(layer) is type(own) else layer for layer in layers]
    return view


def _to_meta(value: Any) -> Any:
    """``value`` with every tensor in it (in tuples, lists, dicts) on the meta device."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _seen(view: Any, index: int) -> int | None:
    """The positions block ``index``'s cache holds (0 without a cache); None for a layer whose
    cache keeps a state, not positions (linear attention)."""
    if view is None:
        return 0
    try:
        seen: int = view.get_seq_length(index)
    except ValueError:
        return None
    return seen


class _Part(nn.Module):
    """A pipesvc layer made of some of the model's parts (see [Note: the body's own code] in
    ``hf_body.py``)."""

    def __init__(
        self, skeleton: Skeleton, parts: Mapping[str, tuple[str, nn.Module]], shared: nn.ModuleDict
    ) -> None:
        super().__init__()
        self.skeleton = skeleton
        self.paths = {local: path for local, (path, _) in parts.items()}
        """Each child's local name -> its path in the model (``stored_names``)."""
        for local, (_, module) in parts.items():
            self.add_module(local, module)
        self.shared = shared  # the body's modules without parameters, this layer's copies
        self.paths["shared"] = skeleton.family.body

    def _own(self) -> dict[str, nn.Module]:
        """The body's attribute names -> this layer's modules for them."""
        own: dict[str, nn.Module] = dict(self.shared.items())
        for local, path in self.paths.items():
            if local != "shared" and path.startswith(f"{self.skeleton.family.body}."):
                own[path.rpartition(".")[2]] = getattr(self, local)
        return own


class Embedding(_Part):
    """Token ids ``[B, T]`` -> hidden states ``[B, T, H]``: the body's code before its first
    decoder layer."""

    side_inputs = ("position_ids",)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if ids.is_meta:  # describing: sizes only (the body's code reads values)
            hidden: torch.Tensor = self.get_submodule("embed")(ids)
            return hidden
        body = self.skeleton.body_shell(self._own())

        def entered(index: int, hidden: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
            hf_body.stop(hidden)

        if position_ids is not None:
            position_ids = position_ids.to(ids.device)
        # Without positions the body counts 0..T-1 itself, as transformers' forward does.
        call = functools.partial(
            body,
            input_ids=ids,
            position_ids=position_ids,
            use_cache=False,
            **self.skeleton.quiet,
        )
        hidden = hf_body.run(call, entered)
        if not isinstance(hidden, torch.Tensor):
            raise hf_body.not_reached("the embedding")
        return hidden


class Block(_Part):
    """One decoder block: hidden states in and out, with the batch's padding mask as a side
    input (see [Note: Hugging Face layers])."""

    side_inputs = ("attention_mask", "position_ids")
    uses_cache = True

    def __init__(
        self,
        skeleton: Skeleton,
        parts: Mapping[str, tuple[str, nn.Module]],
        shared: nn.ModuleDict,
        index: int,
        router: RouterLoss | None = None,
    ) -> None:
        super().__init__(skeleton, parts, shared)
        self.index = index
        # With the router's auxiliary loss, training adds this block's routing statistics to
        # the carried vector (see [Note: the router's auxiliary loss] in hf_router.py).
        self._tap = RouterTap(self.get_submodule("block"), router) if router else None
        self.adds_to_carry = self._tap is not None and bool(self._tap.routers)

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        carry: Carry | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` covers the cached positions and the new ones (``[B, past + T]``),
        ``position_ids`` the new ones (``[B, T]``); ``cache`` (a ``transformers`` cache) holds
        the keys and values of earlier positions and takes this call's; ``carry`` (training
        with the router's auxiliary loss) takes the block's routing statistics."""
        view = _cache_view(cache, self.index) if cache is not None else None
        past = _seen(view, self.index)
        if past is None:  # a layer that keeps no positions (linear attention): the mask's
            past = attention_mask.shape[1] - hidden.shape[1] if attention_mask is not None else 0
        expected = (hidden.shape[0], past + hidden.shape[1])
        if attention_mask is not None and tuple(attention_mask.shape) != expected:
            raise InvalidArgumentError(
                f"attention_mask of shape {list(attention_mask.shape)} for hidden states of "
                f"shape {list(hidden.shape)} after {past} cached positions; expected "
                f"{list(expected)}"
            )
        given = position_ids
        if position_ids is None and view is not None:
            position_ids = _positions(hidden.shape[1], past, hidden.device)
        if hidden.is_meta:  # describing: the body's code on zeros, its arguments on meta
            zeros = torch.zeros(hidden.shape, dtype=hidden.dtype)
            positions = _positions(hidden.shape[1], 0, zeros.device)
            args, kwargs = _to_meta(self._arguments(zeros, None, positions, None, described=True))
            try:
                out = self.get_submodule("block")(hidden, *args, **kwargs)
            except (RuntimeError, NotImplementedError):
                # Routing to experts depends on values, which meta tensors do not have: the
                # block keeps its input's shape, and what it saves is counted up to there.
                return hidden.clone()
        else:
            args, kwargs = self._shared_arguments(
                hidden, attention_mask, given, position_ids, cache, view
            )
            tap = self._tap if carry is not None else None
            if tap is not None:
                tap.start()
            out = self.get_submodule("block")(hidden, *args, **kwargs)
            if tap is not None and carry is not None:
                terms = tap.terms(attention_mask)
                if terms is not None:
                    carry.add(terms)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    def _shared_arguments(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        given: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: Any,
        view: Any,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """What the body passes to this decoder layer besides the hidden states: from the
        prologue an earlier block of this forward ran, when it fits (see [Note: shared
        prologue] in ``hf_prologue.py``; ``given``: the positions as this block got them)."""
        found = hf_prologue.arguments_for(
            self.skeleton, self.index, lambda: self.skeleton.body_shell(self._own()),
            hidden, attention_mask, given, position_ids, cache, view,
        )  # fmt: skip
        if found is None:
            return self._arguments(hidden, attention_mask, position_ids, view)
        return found

    def _arguments(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        view: Any,
        *,
        described: bool = False,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """What the body passes to this decoder layer besides the hidden states (``described``:
        computed with the skeleton's modules, whose buffers are real, for a layer on meta)."""
        own = {} if described else self._own()
        body = self.skeleton.body_shell(own, shared=described)
        mine = self.index

        def arguments(index: int, passed: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
            if index == mine:
                hf_body.stop((args, kwargs))
            return passed

        call = hf_prologue.body_call(
            self.skeleton, body, hidden, attention_mask, position_ids, view
        )
        found = hf_body.run(call, arguments)
        if not isinstance(found, tuple):
            raise hf_body.not_reached(f"decoder layer {mine}")
        return found


class Head(_Part):
    """Final norm and LM head: hidden states -> logits ``[B, T, vocab]``, with the causal LM's
    own code after its body (logit soft-capping or scaling where the family has it)."""

    positionwise = True  # see [Note: last position only] in pipesvc.stage.compute.layer_calls

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.is_meta:  # describing: sizes only
            logits: torch.Tensor = self.get_submodule("head")(hidden)
            return logits
        model = self.skeleton.model_shell(self._own(), self.get_submodule("head"))

        def entered(index: int, passed: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
            return hidden if index == 0 else passed

        call = functools.partial(
            model, inputs_embeds=hidden.detach(), use_cache=False, **self.skeleton.quiet
        )
        out = hf_body.run(call, entered)
        found = getattr(out, "logits", None)
        if not isinstance(found, torch.Tensor):
            raise hf_body.not_reached("the head")
        return found


def stored_names(
    ckpt: Checkpoint, index: int, layer: nn.Module, *, reading: bool = True
) -> dict[str, str]:
    """Each ``state_dict`` name of pipesvc layer ``index`` -> the model's own name for it.

    ``reading``: the name to read from the checkpoint, where a tied head is the embedding's
    tensor; otherwise the name in the model's ``state_dict()``, where the head has its own.
    """
    paths: dict[str, str] = dict(cast(Any, layer).paths)
    if index == ckpt.num_blocks + 1 and ckpt.tied and reading:
        paths["head"] = ckpt.family.embed_path
    names = {}
    for local in layer.state_dict():
        part, _, rest = local.partition(".")
        names[local] = f"{paths[part]}.{rest}"
    return names


def export_info(
    directory: str | os.PathLike[str], lora: Mapping[str, object] | None = None
) -> dict[str, object]:
    """What a client needs to write the model as a Hugging Face directory: the original
    ``config.json``, the dtype the model is stored in, the key map (``model_keys``), the tied
    tensors' keys and the LoRA arguments (see ``pipesvc.models.hf_export``)."""
    where = str(Path(directory).resolve())
    ckpt = checkpoint_of(where)
    return {
        "format": "huggingface",
        "source": where,
        "config": ckpt.raw_config,
        "dtype": ckpt.stored_dtype,
        "keys": model_keys(where, lora),
        "embed_key": f"{ckpt.family.embed_path}.weight",
        "head_key": f"{ckpt.family.head}.weight",
        "layout": ckpt.layout.as_dict(),
        "lora": dict(lora) if lora is not None else None,
    }


def model_keys(
    directory: str | os.PathLike[str], lora: Mapping[str, object] | None = None
) -> dict[str, str]:
    """Every ``"{layer}.{name}"`` key of the pipesvc model -> the key of the Hugging Face
    model's own ``state_dict()`` (LoRA adapters under peft's names); builds on meta only."""
    where = str(Path(directory).resolve())
    ckpt = checkpoint_of(where)
    keys = {}
    with torch.device("meta"):
        for index, spec in enumerate(hf_layer_specs(where, lora)):
            layer = spec.build()
            for local, name in stored_names(ckpt, index, layer, reading=False).items():
                keys[f"{index}.{local}"] = name
    return keys


def tied_keys(directory: str | os.PathLike[str]) -> list[tuple[str, ...]]:
    """The tied groups of the model in ``directory``: the input embedding and the head when
    its config ties them (see [Note: tied parameters] in ``pipesvc.core.tying``)."""
    ckpt = checkpoint_of(str(Path(directory).resolve()))
    if not ckpt.tied:
        return []
    return [("0.embed.weight", f"{ckpt.num_blocks + 1}.head.weight")]


def build_hf_layer(
    directory: str, index: int, lora: Mapping[str, object] | None = None
) -> nn.Module:
    """Builds layer ``index`` of the model in ``directory`` with its checkpoint tensors.

    On the meta device (describing the model) nothing is read. With ``lora`` the layer gets
    adapters and only they train (see [Note: LoRA on stages]).
    """
    ckpt = checkpoint_of(directory)
    model, family, last = ckpt.meta_model, ckpt.family, ckpt.num_blocks + 1
    if not 0 <= index <= last:
        raise InvalidArgumentError(f"layer {index} is outside [0, {last}] of {directory!r}")

    def parts(named: Sequence[tuple[str, str]]) -> dict[str, tuple[str, nn.Module]]:
        return {local: (path, copy.deepcopy(part_of(model, path))) for local, path in named}

    skeleton = skeleton_of(directory)
    shared = nn.ModuleDict(
        {path.rpartition(".")[2]: copy.deepcopy(part_of(model, path)) for path in family.shared}
    )  # computed buffers only (rotary tables): nothing stored, nothing trained
    layer: nn.Module
    if index == 0:
        layer = Embedding(skeleton, parts(family.embed), shared)
    elif index == last:
        layer = Head(skeleton, parts((*family.norm, ("head", family.head))), shared)
    else:
        block = parts((("block", f"{family.blocks}.{index - 1}"),))
        layer = Block(skeleton, block, shared, index - 1, _router_loss(directory))
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


@functools.lru_cache(maxsize=MODELS_KEPT)
def _router_loss(directory: str) -> RouterLoss | None:
    return router_loss_of(checkpoint_of(directory).meta_model, repr(directory))


def hf_layer_specs(
    directory: str | os.PathLike[str], lora: Mapping[str, object] | None = None
) -> list[LayerSpec]:
    """The unbuilt layers of the model in ``directory``: embedding, blocks, norm with head;
    with LoRA adapters where ``lora`` says (peft's ``LoraConfig`` fields)."""
    where = str(Path(directory).resolve())
    ckpt = checkpoint_of(where)
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
    checkpoint_of(where).prepare()
    skeleton_of(where).check()
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

    def carry(lora: dict[str, object] | None = None) -> CarrySpec | None:
        router = _router_loss(directory)
        return router.carry() if router is not None else None

    def max_positions(lora: dict[str, object] | None = None) -> int | None:
        # The config's limit (gpt2's n_positions answers to this name too); a family
        # without one has none.
        limit = getattr(checkpoint_of(directory).meta_model.config, "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    factory.export = export  # type: ignore[attr-defined]
    factory.tied = tied  # type: ignore[attr-defined]
    factory.side_inputs = ("attention_mask", "position_ids")  # type: ignore[attr-defined]
    factory.new_cache = new_cache  # type: ignore[attr-defined]
    factory.cache_layout = layout  # type: ignore[attr-defined]
    factory.max_positions = max_positions  # type: ignore[attr-defined]
    factory.carry = carry  # type: ignore[attr-defined]

    factory.__qualname__ = f"hf_model[{directory}]"
    return factory
