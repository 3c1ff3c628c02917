"""Optimizers a job can name, built from a JSON spec on each stage for its own parameters."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from pipesvc.errors import InvalidArgumentError

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
_JSON_SCALARS = (bool, int, float, str, type(None))

DEFAULT_OPTIMIZER: Mapping[str, Any] = MappingProxyType({"name": "adamw", "lr": 1e-3})
"""The optimizer a job gets unless it names one (``create_job(optimizer=None)``: none)."""

NO_OPTIMIZER = "none"
"""The optimizer name of an inference job (``create_job(optimizer=None)``): weights only, no
gradients, no optimizer state; it serves ``forward`` and generation and cannot train."""


def trains(spec: Mapping[str, object]) -> bool:
    """Whether a job with this optimizer spec trains (it is not an inference job)."""
    return spec.get("name") != NO_OPTIMIZER


def check_optimizer(spec: Mapping[str, object]) -> None:
    """Validates ``{"name": ..., **kwargs}`` against the optimizer's signature.

    Raises:
        InvalidArgumentError: unknown name, unknown keyword, or a non-JSON value.
    """
    name = spec.get("name")
    if name == NO_OPTIMIZER:
        if set(spec) != {"name"}:
            raise InvalidArgumentError(
                f"an inference job (optimizer {NO_OPTIMIZER!r}) takes no optimizer arguments; "
                f"got {sorted(set(spec) - {'name'})}"
            )
        return
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise InvalidArgumentError(
            f"optimizer name {name!r} is not supported; expected one of "
            f"{sorted(OPTIMIZERS)} (or None for an inference job)"
        )
    accepted = [p for p in inspect.signature(OPTIMIZERS[name]).parameters if p != "params"]
    for key, value in spec.items():
        if key == "name":
            continue
        if key not in accepted:
            raise InvalidArgumentError(
                f"optimizer {name} has no argument {key!r}; accepted: {', '.join(accepted)}"
            )
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, _JSON_SCALARS) for v in values):
            raise InvalidArgumentError(
                f"optimizer argument {key!r} must be a JSON number, string, bool or list; "
                f"got {type(value).__name__}"
            )


def build_optimizer(
    spec: Mapping[str, object], params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """Builds the optimizer named in ``spec`` over ``params``.

    Raises:
        InvalidArgumentError: the spec is invalid or torch refuses its values.
    """
    check_optimizer(spec)
    kwargs: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k != "name"
    }
    try:
        return OPTIMIZERS[str(spec["name"])](params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"optimizer {spec['name']}: {exc}") from exc
