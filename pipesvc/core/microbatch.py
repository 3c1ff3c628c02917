"""Splitting a mini-batch into micro-batches and weighting their losses."""

from __future__ import annotations

import torch

from pipesvc.errors import InvalidArgumentError


def split(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Splits ``batch`` along dimension 0 into ``num_microbatches`` contiguous chunks.

    Sizes differ by at most one (the first chunks are the larger), so an uneven batch works.

    Raises:
        InvalidArgumentError: the batch is a scalar or smaller than ``num_microbatches``.
    """
    if batch.dim() == 0:
        raise InvalidArgumentError("a batch must have a batch dimension; got a scalar tensor")
    if batch.shape[0] < num_microbatches:
        raise InvalidArgumentError(
            f"batch size ({batch.shape[0]}) is smaller than num_microbatches ({num_microbatches})"
        )
    return [chunk.contiguous() for chunk in torch.tensor_split(batch, num_microbatches, dim=0)]


def loss_weights(sizes: list[int]) -> list[float]:
    """Each micro-batch's share of the batch.

    [Note: uneven micro-batches] Scaling micro-batch ``i``'s mean loss by ``n_i / N`` makes
    the sum of the scaled losses, and of their gradients, equal to the whole-batch mean loss
    and its gradient, whatever the split. ``n_i`` counts what the loss averages over: rows, or
    for a causal LM the labels that count (``loss.loss_units``), so padding spread unevenly
    over the micro-batches still gives the whole batch's mean. With nothing to count anywhere
    every weight is 0.
    """
    total = sum(sizes)
    return [size / total if total else 0.0 for size in sizes]
