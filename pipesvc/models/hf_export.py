"""Writing a trained model back as a Hugging Face directory, and LoRA adapters in peft's format.

[Note: Hugging Face export] ``write_model`` writes ``config.json`` and the weights as
safetensors (one ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
``model.safetensors.index.json``), the layout ``from_pretrained`` reads. Tensors are written
in the dtype the model was stored in (see [Note: stored dtype] in ``hf_checkpoint.py``;
bfloat16 for a bfloat16 checkpoint although the job trained float32 weights), or the one the
caller names, and the config's ``dtype`` says which. A config
that ties the embedding and the head is kept tied only if the two trained copies are still
equal; otherwise it is written untied with both tensors, so the loaded model computes what the
job computed. Files are written beside their final place and moved there, overwriting only
the format's own files and deleting none that pipesvc did not write (see [Note: saving beside]
in ``pipesvc.storage.publish``). LoRA adapters go out either as peft's adapter directory
(``adapter_config.json`` and ``adapter_model.safetensors``, keys without the adapter's name)
or merged into the base weights (``W + B @ A * scale``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.hf_convert import Layout
from pipesvc.models.lora import ADAPTER_MARK, check_lora
from pipesvc.storage.publish import WRITER, Staging
from pipesvc.storage.weights import save_weights

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_NAME = "default"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_FILES = re.compile(r"model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors")
"""The weight files of a model directory (``config.json`` is always rewritten)."""
ADAPTER_FILES = re.compile(r"adapter_model\.safetensors|adapter_config\.json")
METADATA = {"format": "pt", **WRITER}


def _config_dtype(config: Mapping[str, Any]) -> str:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(name) if name in DTYPES else "float32"


def dtype_name(dtype: str | torch.dtype) -> str:
    """``"bfloat16"`` for ``"bfloat16"`` or ``torch.bfloat16``: a dtype a model is written in.

    Raises:
        InvalidArgumentError: not one of ``DTYPES``.
    """
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name not in DTYPES:
        raise InvalidArgumentError(
            f"dtype {dtype!r} is not one a model is written in; expected one of {', '.join(DTYPES)}"
        )
    return name


def _written(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as written: floating-point ones in ``dtype``, others as they are."""
    tensor = tensor.detach()
    return (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()


def _shards(state: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _save_into(
    directory: str | os.PathLike[str],
    write: Callable[[Path], None],
    owned: re.Pattern[str],
    last: Sequence[str],
) -> None:
    """``write`` fills a temporary directory, published to ``directory`` (see [Note: saving
    beside])."""
    staging = Staging(directory, owned=owned, last=last)
    try:
        write(staging.path)
        staging.publish()
    except BaseException:
        staging.discard()
        raise


def write_model(
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    directory: str | os.PathLike[str],
    *,
    embed_key: str,
    head_key: str,
    max_shard_bytes: int = 5 << 30,
    dtype: str | torch.dtype | None = None,
    layout: Mapping[str, Any] | None = None,
) -> None:
    """Writes ``state`` (the model's own keys) and ``config`` as a Hugging Face directory.

    ``layout`` (``Layout.as_dict()``) names how the files hold the tensors: per expert where
    the model stacks its experts (see [Note: stored layouts] in ``hf_convert.py``), as
    ``save_pretrained`` writes them.

    ``embed_key`` and ``head_key`` name the input embedding's and the head's weights, for tied
    configs (see [Note: Hugging Face export]). Floating-point tensors are written in ``dtype``
    (by default the one ``config`` names), which the written config names.

    Raises:
        InvalidArgumentError: ``max_shard_bytes`` is not positive, ``dtype`` is not one of
            ``DTYPES``, or ``directory`` is not a directory.
        FailedPreconditionError: ``directory`` holds weight files pipesvc did not write that
            this save would leave stale (see [Note: saving beside]).
    """
    if max_shard_bytes <= 0:
        raise InvalidArgumentError(f"max_shard_bytes ({max_shard_bytes}) must be positive")
    config = dict(config)
    name = dtype_name(dtype) if dtype is not None else _config_dtype(config)
    config["dtype"] = name  # what from_pretrained(dtype="auto") loads it in
    if "torch_dtype" in config:
        config["torch_dtype"] = name  # the older key, which older transformers read
    tensors = {k: _written(v, DTYPES[name]) for k, v in state.items()}
    if config.get("tie_word_embeddings") and head_key in tensors:
        if embed_key in tensors and torch.equal(tensors[embed_key], tensors[head_key]):
            del tensors[head_key]
        else:
            config["tie_word_embeddings"] = False  # the copies differ: keep both
    tensors = Layout.from_dict(layout).to_stored(tensors)
    shards = _shards(tensors, max_shard_bytes)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if len(shards) == 1:
            save_weights(shards[0], tmp / SINGLE_FILE, metadata=METADATA, flush=False)
            return
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_weights(shard, tmp / name, metadata=METADATA, flush=False)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total, **WRITER}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    _save_into(directory, write, MODEL_FILES, (INDEX_FILE,))


def split_adapters(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base weights, LoRA adapter weights) of a state dict."""
    base = {k: v for k, v in state.items() if ADAPTER_MARK not in k}
    adapters = {k: v for k, v in state.items() if ADAPTER_MARK in k}
    return base, adapters


def _base_name(adapter_key: str) -> tuple[str, str]:
    """``x.q_proj.lora_A.default.weight`` -> (``x.q_proj.base_layer.weight`` or
    ``x.q_proj.weight``, ``A``)."""
    module, _, rest = adapter_key.partition(f".{ADAPTER_MARK}")
    which = rest[0]
    return f"{module}.weight", which


def merge_adapters(state: Mapping[str, torch.Tensor], lora: Mapping[str, Any]) -> dict[str, Any]:
    """The base weights with each adapter's ``B @ A * scale`` added, adapter keys dropped.

    peft keeps a wrapped module's own weight under ``base_layer``; the merged model has it
    under the module's plain name again.
    """
    args = check_lora(lora)
    r = int(args.get("r", 8))  # type: ignore[call-overload]
    alpha = float(args.get("lora_alpha", 8))  # type: ignore[arg-type]
    scale = alpha / math.sqrt(r) if args.get("use_rslora") else alpha / r
    base, adapters = split_adapters(state)
    merged = {k.replace(".base_layer.", "."): v.clone() for k, v in base.items()}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapters.items():
        weight, which = _base_name(key)
        pairs.setdefault(weight, {})[which] = tensor
    for weight, pair in pairs.items():
        delta = (pair["B"].float() @ pair["A"].float()) * scale
        merged[weight] = (merged[weight].float() + delta).to(merged[weight].dtype)
    return merged


def write_adapter(
    adapters: Mapping[str, torch.Tensor],
    lora: Mapping[str, Any],
    directory: str | os.PathLike[str],
    *,
    base_model: str = "",
) -> None:
    """Writes LoRA adapters (the model's own keys) as peft's adapter directory.

    Raises:
        InvalidArgumentError: ``directory`` is not a directory.
    """
    args = check_lora(lora)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": args.get("r", 8),
        "lora_alpha": args.get("lora_alpha", 8),
        "lora_dropout": args.get("lora_dropout", 0.0),
        "target_modules": sorted(args["target_modules"]),  # type: ignore[call-overload]
        "use_rslora": args.get("use_rslora", False),
        "bias": "none",
        "inference_mode": True,
    }
    tensors = {
        "base_model.model." + k.replace(f".{ADAPTER_NAME}.", "."): v.detach().contiguous()
        for k, v in adapters.items()
    }

    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_weights(tensors, tmp / "adapter_model.safetensors", metadata=METADATA, flush=False)

    _save_into(directory, write, ADAPTER_FILES, ("adapter_config.json",))
