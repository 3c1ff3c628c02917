"""Loss functions a job can name, computed on the last stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipesvc.errors import InvalidArgumentError

LOSSES: tuple[str, ...] = ("cross_entropy", "mse")


def check_loss(name: str) -> None:
    """Raises InvalidArgumentError unless ``name`` is one of LOSSES."""
    if name not in LOSSES:
        raise InvalidArgumentError(f"loss {name!r} is not supported; expected one of {LOSSES}")


def compute_loss(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean-reduced loss of ``output`` against ``target``.

    ``cross_entropy`` takes logits with classes in the last dimension (so a language model's
    ``(B, T, V)`` logits against ``(B, T)`` token ids work) and integer class targets.

    Raises:
        InvalidArgumentError: unknown loss or shapes/dtypes that do not fit it.
    """
    check_loss(name)
    try:
        if name == "mse":
            if output.shape != target.shape:
                raise InvalidArgumentError(
                    f"mse target shape {list(target.shape)} differs from the output shape "
                    f"{list(output.shape)}"
                )
            return F.mse_loss(output, target.to(output.dtype))
        if target.is_floating_point():
            raise InvalidArgumentError(
                f"cross_entropy needs integer class targets; got dtype {target.dtype}"
            )
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    except (RuntimeError, IndexError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{name} loss failed on output {list(output.shape)} and target "
            f"{list(target.shape)}: {exc}"
        ) from exc
