"""A stage's state as it is saved and restored: its weights and optimizer state, checked in
full before any of it is applied (no gRPC here)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.storage.checkpoint import OPTIM_PREFIX, group_by_layer


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedState:
    """State checked by ``prepare_state``, ready to apply."""

    weights: dict[str, torch.Tensor]
    optim_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]]
    has_optim: bool


def state_tensors(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, kind: str
) -> dict[str, torch.Tensor]:
    """``module``'s tensors under global keys, by ``kind``: ``"parameters"`` (the
    state_dict), ``"gradients"`` (each parameter's, where it has one) or ``"checkpoint"`` (the
    state_dict plus optimizer state under OPTIM_PREFIX keys, grouped by layer)."""
    if kind == "gradients":
        return {n: p.grad.detach() for n, p in module.named_parameters() if p.grad is not None}
    result = {k: v.detach() for k, v in module.state_dict().items()}
    if kind == "checkpoint" and optimizer is not None:
        for name, p in module.named_parameters():
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    result[f"{OPTIM_PREFIX}{name}.{key}"] = value.detach()
        return dict(group_by_layer(result))
    return result


def held_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor ``module`` and ``optimizer`` hold: weights and buffers, gradients and
    optimizer state (see ``storage_bytes``)."""
    held = list(module.state_dict().values())
    held += [p.grad for p in module.parameters() if p.grad is not None]
    if optimizer is not None:
        for slots in optimizer.state.values():
            held += [v for v in slots.values() if isinstance(v, torch.Tensor)]
    return held


def prepare_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    layers: tuple[int, int],
    staged: dict[str, torch.Tensor],
    *,
    owned: bool = False,
) -> PreparedState:
    """Checks that ``staged`` is exactly ``module``'s state_dict (plus, optionally, optimizer
    state under OPTIM_PREFIX keys) and prepares it; changes nothing. ``layers``: the range the
    module holds, for the errors.

    ``owned``: the caller hands ``staged`` over (it was decoded for this call and is dropped
    after it), so its optimizer tensors already on the right device become the optimizer
    state as they are; a copy would hold that state twice while a recovery restores it, above
    the budget the plan counted.

    Raises:
        InvalidArgumentError: missing or unexpected keys, or a shape or dtype mismatch.
    """
    weights = {k: v for k, v in staged.items() if not k.startswith(OPTIM_PREFIX)}
    optim = {k[len(OPTIM_PREFIX) :]: v for k, v in staged.items() if k.startswith(OPTIM_PREFIX)}
    current = module.state_dict()
    missing = sorted(set(current) - set(weights))
    unexpected = sorted(set(weights) - set(current))
    if missing or unexpected:
        raise InvalidArgumentError(
            f"state for layers [{layers[0]}, {layers[1]}) is missing "
            f"{missing[:5]} and has unexpected {unexpected[:5]}"
        )
    for name, tensor in weights.items():
        if tensor.shape != current[name].shape or tensor.dtype != current[name].dtype:
            raise InvalidArgumentError(
                f"state tensor {name} has shape {list(tensor.shape)} {tensor.dtype}; "
                f"expected {list(current[name].shape)} {current[name].dtype}"
            )
    params = dict(module.named_parameters())
    optim_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for key, tensor in optim.items():
        name, _, slot = key.rpartition(".")
        if name not in params or optimizer is None:
            raise InvalidArgumentError(
                f"optimizer state {OPTIM_PREFIX}{key} names no parameter of layers "
                f"[{layers[0]}, {layers[1]})"
            )
        param = params[name]
        if tensor.dim() > 0 and (tensor.shape != param.shape or tensor.dtype != param.dtype):
            raise InvalidArgumentError(
                f"optimizer state {OPTIM_PREFIX}{key} is {list(tensor.shape)} "
                f"{tensor.dtype}; its parameter is {list(param.shape)} {param.dtype}"
            )
        if tensor.dim() == 0 and not tensor.is_floating_point():
            raise InvalidArgumentError(
                f"optimizer state {OPTIM_PREFIX}{key} is a {tensor.dtype} scalar; "
                "a floating-point one is expected"
            )
        # Scalars (Adam's step count) stay on the CPU, as torch keeps them.
        device = param.device if tensor.dim() > 0 else torch.device("cpu")
        optim_state.setdefault(param, {})[slot] = tensor.to(device, copy=not owned)
    return PreparedState(weights=weights, optim_state=optim_state, has_optim=bool(optim))


def apply_state(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, prepared: PreparedState
) -> None:
    """Applies what ``prepare_state`` prepared to ``module`` and ``optimizer``."""
    current = module.state_dict()
    with torch.no_grad():
        for name, tensor in prepared.weights.items():
            current[name].copy_(tensor)
    if prepared.has_optim and optimizer is not None:
        optimizer.state.clear()
        for param, slots in prepared.optim_state.items():
            optimizer.state[param] = slots


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the memory ``tensors`` hold, each storage once (views, tied parameters and a
    state_dict's aliases of parameters count once, and a view holds its whole storage)."""
    storages: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
