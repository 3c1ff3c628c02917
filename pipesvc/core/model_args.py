"""What a job may say about its model before any model is built (no gRPC, no model registry):
its arguments, JSON-typed only, and the dtypes and dimensions its input may be described with.
The job's configuration checks these in ``pipesvc.core``; the model registry builds on them."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pipesvc.errors import InvalidArgumentError

MAX_ARG_DEPTH = 8
"""Deepest nesting of lists and dicts allowed inside one model argument."""

_JSON_SCALARS = (str, int, float, bool, type(None))

INPUT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}
"""Dtypes a model input may be described with."""
MAX_INPUT_DIMS = 8
"""Most dimensions a described input has."""


def check_model_args(model_args: Mapping[str, object]) -> None:
    """Checks that model arguments are JSON-typed: the only kind a request may carry.

    Raises:
        InvalidArgumentError: a key is not a string, a value is not JSON-typed (str, int,
            float, bool, None, list, dict with str keys), or nesting exceeds ``MAX_ARG_DEPTH``.
    """
    if not isinstance(model_args, Mapping):
        raise InvalidArgumentError(f"model_args must be a mapping, got {type(model_args).__name__}")
    for key, value in model_args.items():
        if not isinstance(key, str):
            raise InvalidArgumentError(
                f"model argument names must be strings, got {key!r} ({type(key).__name__})"
            )
        _check_json_value(key, value, depth=0)


def _check_json_value(path: str, value: object, *, depth: int) -> None:
    # Exact types: a subclass of int or dict could carry behaviour that JSON cannot.
    if type(value) in _JSON_SCALARS:
        return
    if type(value) not in (list, dict):
        raise InvalidArgumentError(
            f"model argument {path!r} has type {type(value).__name__}; only JSON types "
            "(str, int, float, bool, None, list, dict) are allowed"
        )
    if depth >= MAX_ARG_DEPTH:
        raise InvalidArgumentError(
            f"model argument {path!r} nests lists/dicts deeper than {MAX_ARG_DEPTH} levels"
        )
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(f"{path}[{i}]", item, depth=depth + 1)
        return
    assert isinstance(value, dict)
    for key, item in value.items():
        if type(key) is not str:
            raise InvalidArgumentError(
                f"model argument {path!r} has a dict key {key!r} of type "
                f"{type(key).__name__}; keys must be strings"
            )
        _check_json_value(f"{path}.{key}", item, depth=depth + 1)
