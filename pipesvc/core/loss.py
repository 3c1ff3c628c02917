"""Loss functions a job can name, computed on the last stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipesvc.errors import InvalidArgumentError

LOSSES: tuple[str, ...] = ("causal_lm", "cross_entropy", "mse")
IGNORE_INDEX = -100
"""A ``causal_lm`` label that counts for nothing (padding, prompt tokens), as in transformers."""


def check_loss(name: str) -> None:
    """Raises InvalidArgumentError unless ``name`` is one of LOSSES."""
    if name not in LOSSES:
        raise InvalidArgumentError(f"loss {name!r} is not supported; expected one of {LOSSES}")


def compute_loss(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean-reduced loss of ``output`` against ``target``.

    ``cross_entropy`` takes logits with classes in the last dimension (so a language model's
    ``(B, T, V)`` logits against ``(B, T)`` token ids work) and integer class targets.
    ``causal_lm`` takes ``(B, T, V)`` logits and ``(B, T)`` labels shaped like the input ids:
    position ``t`` predicts label ``t + 1`` (the shift happens here), labels equal to
    ``IGNORE_INDEX`` count for nothing, and the mean is over the labels that count (0 with a
    zero gradient when none does), as ``transformers``' ``model(ids, labels=labels).loss``.

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
                f"{name} needs integer class targets; got dtype {target.dtype}"
            )
        if name == "causal_lm":
            return _causal_lm(output, target)
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    except (RuntimeError, IndexError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{name} loss failed on output {list(output.shape)} and target "
            f"{list(target.shape)}: {exc}"
        ) from exc


def _causal_lm(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise InvalidArgumentError(
            f"causal_lm needs logits (B, T, V) and labels (B, T); got logits "
            f"{list(logits.shape)} and labels {list(labels.shape)}"
        )
    shifted = labels[:, 1:].reshape(-1)
    predicted = logits[:, :-1].reshape(-1, logits.shape[-1])
    if not bool((shifted != IGNORE_INDEX).any()):
        return predicted.sum() * 0.0  # nothing counts: zero loss, zero gradient, no NaN
    return F.cross_entropy(predicted, shifted, ignore_index=IGNORE_INDEX)


def loss_units(name: str, target: torch.Tensor) -> int:
    """What a loss averages over in one micro-batch: its rows, or for ``causal_lm`` the labels
    that count after the shift (see [Note: uneven micro-batches] in ``core.microbatch``)."""
    if name == "causal_lm" and target.dim() >= 2:
        return int((target[:, 1:] != IGNORE_INDEX).sum())
    return int(target.shape[0]) if target.dim() else 1
