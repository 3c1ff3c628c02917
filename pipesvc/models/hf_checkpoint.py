"""A Hugging Face model directory: its config, family, tensor index and meta skeleton.

Security: a directory is named by the operator who starts the stage, never by a request;
``config.json`` is read as JSON and no code from the directory runs (``trust_remote_code`` stays
off); the weight index may only name files inside the directory.

[Note: stored dtype] The dtype a checkpoint's files are stored in (bfloat16 for nearly every
published checkpoint) is not the dtype a job computes in. The skeleton is built in float32
whatever ``config.json`` names (``from_config`` would take the config's dtype), so every stage
materialises float32 parameters, the planner's description counts float32 bytes, and the
precision decides from there (``bf16`` casts the built layers; ``fp32`` and ``bf16-mixed`` keep
float32 weights, gradients and optimizer state, as ``transformers`` loaded with
``dtype=torch.float32``). The stored dtype is kept only as what an export writes back
(``Checkpoint.stored_dtype``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError, NotFoundError
from pipesvc.models.hf_convert import Layout, layout_of
from pipesvc.models.hf_family import Family, find_family
from pipesvc.models.hf_router import router_loss_of
from pipesvc.models.rng import RNG_LOCK
from pipesvc.storage.weights import read_header, read_tensors

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
"""Largest ``config.json`` or index read (1 MiB; real ones are a few KiB to a few hundred)."""
FLOAT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""The floating-point dtypes a model is stored in: name -> safetensors' code for it."""


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
        self.raw_config = config
        """``config.json`` as written (what an export writes back)."""
        self.model_type = str(config.get("model_type", ""))
        _check_causal_lm(self.directory, self.model_type)
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
        """The ``transformers`` config (its attention implementation is the one
        ``transformers`` picks for the family, as ``from_pretrained`` would)."""
        from transformers import AutoConfig  # optional dependency, imported when used

        where = str(self.directory)
        try:
            config = AutoConfig.from_pretrained(
                where, local_files_only=True, trust_remote_code=False
            )
        except (ValueError, KeyError) as exc:
            raise InvalidArgumentError(
                f"{where!r}: model_type {self.model_type!r} is not one transformers knows "
                f"without remote code: {exc}"
            ) from None
        return config

    @functools.cached_property
    def family(self) -> Family:
        """Where the model's parts are (see [Note: recognising a family])."""
        try:
            return find_family(self.meta_model, self.model_type)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{str(self.directory)!r}: {exc}") from None

    @functools.cached_property
    def meta_model(self) -> nn.Module:
        """The whole model with its parameters on the meta device (no memory) and its buffers
        real: computed buffers that no checkpoint holds (rotary frequencies, embedding scales)
        keep their values."""
        from transformers import AutoModelForCausalLM

        with RNG_LOCK, _parameters_on_meta():
            # float32 whatever the config names (see [Note: stored dtype]).
            model: nn.Module = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        return model

    @functools.cached_property
    def stored_dtype(self) -> str:
        """The dtype the model is stored in, as ``transformers`` decides it for ``dtype="auto"``:
        the one ``config.json`` names, else that of the first floating-point tensor stored,
        else float32 (see [Note: stored dtype])."""
        named = self.raw_config.get("dtype") or self.raw_config.get("torch_dtype")
        if isinstance(named, str) and named in FLOAT_DTYPES:
            return named
        codes = {code: name for name, code in FLOAT_DTYPES.items()}
        for file in dict.fromkeys(self.files.values()):
            for entry in read_header(file).values():
                if entry.dtype in codes:
                    return codes[entry.dtype]
        return "float32"

    def prepare(self) -> None:
        """Parses the config, builds the skeleton and finds its parts now (importing
        ``transformers`` and the family's modelling code), so a model that does not fit fails at
        start, not at the first job.

        Raises:
            InvalidArgumentError: the model does not fit (see [Note: recognising a family]),
                or its config asks for a router's auxiliary loss its family computes in a
                form pipesvc does not carry across stages (see [Note: the router's auxiliary
                loss] in ``hf_router.py``).
        """
        _ = self.family
        router_loss_of(self.meta_model, repr(str(self.directory)))

    @property
    def num_blocks(self) -> int:
        return len(part_of(self.meta_model, self.family.blocks))

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @functools.cached_property
    def layout(self) -> Layout:
        """How the files store the model's tensors (see [Note: stored layouts]), with the
        family's older names (``STORED_ALIASES``) as renamings."""
        layout = layout_of(self.model_type)
        aliases = tuple((f"{older}.", f"{path}.") for path, older in self.family.stored)
        return Layout(layout.renamings + aliases, layout.merges)

    def read(self, names: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """``{local name: model name}`` -> ``{local name: tensor}``, each file read once; a
        tensor the files hold per expert is stacked from them (see [Note: stored layouts])."""
        plans = {local: self._sources(name) for local, name in names.items()}
        by_file: dict[Path, list[str]] = {}
        for stored_names, _ in plans.values():
            for stored in stored_names:
                by_file.setdefault(self.files[stored], []).append(stored)
        found: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            found.update(read_tensors(file, list(dict.fromkeys(wanted))))
        result = {}
        for local, (stored_names, combine) in plans.items():
            tensors = [found[stored] for stored in stored_names]
            result[local] = combine(tensors) if combine is not None else tensors[0]
        return result

    def _sources(
        self, name: str
    ) -> tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor] | None]:
        """The stored tensors that make the model tensor ``name``, and how to combine them."""
        if name in self.files:
            return [name], None
        if (renamed := self.layout.stored_name(name)) in self.files:
            return [renamed], None
        merged = self.layout.sources(name, self.files.__contains__)
        if merged is not None:
            return merged[0], merged[1]
        raise NotFoundError(f"{str(self.directory)!r} holds no tensor {name!r}")


def _check_causal_lm(directory: Path, model_type: str) -> None:
    """Refuses a ``model_type`` that ``transformers`` has no causal-LM class for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InvalidArgumentError(
            f"{str(directory)!r}: model_type {model_type!r} has no causal-LM class in "
            "transformers; expected a decoder-only language model (llama, gemma3_text, "
            "mixtral, ...)"
        )


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


def part_of(model: nn.Module, path: str) -> Any:
    """``model``'s submodule at the dotted ``path``."""
    part: Any = model
    for attribute in path.split("."):
        part = getattr(part, attribute)
    return part


MODELS_KEPT = 64
"""Hugging Face directories whose skeleton a process keeps built (parameters on meta: a few
buffers each); a stage serving more rebuilds the least recently used one when asked."""


@functools.lru_cache(maxsize=MODELS_KEPT)
def checkpoint_of(directory: str) -> Checkpoint:
    """The checkpoint in ``directory`` (a resolved path), read once per process."""
    return Checkpoint(directory)
