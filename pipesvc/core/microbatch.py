"""Splitting a mini-batch (with its side inputs) into micro-batches and weighting their losses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pipesvc.core.sampling import RowsSampling
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


SIDE_INPUTS = ("attention_mask",)
"""Names of the side inputs a batch may carry beside its inputs: tensors every stage's layers
may read, split into micro-batches like the inputs (see [Note: side inputs])."""


def check_side(inputs: torch.Tensor, side: Mapping[str, torch.Tensor]) -> None:
    """Checks a batch's side inputs against its inputs.

    [Note: side inputs] What a layer needs beside the activations, and only the client has, is
    a side input: the padding ``attention_mask`` of a Hugging Face model, shaped like the token
    ids (``[B, T]``, 1 for a token, 0 for padding; bool or integer). The coordinator splits it
    with the inputs, logs it with the step (a replay sees it again) and sends each stage every
    micro-batch's side inputs with the run request, so a stage computes what its layers need
    (the causal mask with the padding) without it crossing the data plane stage by stage.

    Raises:
        InvalidArgumentError: an unknown name, or a tensor that does not fit ``inputs``.
    """
    for name, tensor in side.items():
        if name not in SIDE_INPUTS:
            raise InvalidArgumentError(
                f"side input {name!r} is unknown; expected one of {list(SIDE_INPUTS)}"
            )
        if tensor.dim() < 2 or list(tensor.shape) != list(inputs.shape[:2]):
            raise InvalidArgumentError(
                f"{name} of shape {list(tensor.shape)} must have the input ids' shape "
                f"{list(inputs.shape[:2])}"
            )
        if tensor.is_floating_point() or tensor.is_complex():
            raise InvalidArgumentError(f"{name} has dtype {tensor.dtype}; expected bool or int")
        if tensor.numel() and not bool(((tensor == 0) | (tensor == 1)).all()):
            raise InvalidArgumentError(f"{name} must hold only 0 and 1")


@dataclass(frozen=True, slots=True)
class CacheRef:
    """The key/value cache one micro-batch of a generation run reads and extends on every stage
    (see [Note: generation sessions] in ``pipesvc.stage.compute.sessions``)."""

    session: str
    part: int
    fresh: bool
    """Start it empty: the prompt, or a replay of every token so far."""
    rows: int
    """The rows of the micro-batch it covers (the part's rows)."""
    positions: int
    """The positions this step adds (the part's own width; 1 for a decode step)."""
    source: str = ""
    """With ``fresh``: start from the first ``source_positions`` positions of this kept
    prefix, not empty (see [Note: prefix reuse] in ``pipesvc.stage.compute.sessions``)."""
    source_positions: int = 0
    keep_as: str = ""
    """After the run, keep the first ``keep_positions`` positions as this prefix."""
    keep_positions: int = 0


MicrobatchCaches = tuple[CacheRef, ...]
"""The caches one micro-batch of a generation run reads and extends: one part's, or several
sessions' parts fused into one micro-batch, their rows one after another, all starting their
caches or all extending them by one position (see [Note: fused decode] in
``pipesvc.stage.compute.fused_cache``)."""


DECODE_SIDE_INPUTS = frozenset({"attention_mask", "position_ids"})
"""The side inputs the stages can carry from one decode step of a run to the next (see [Note:
decode steps on the stages] in ``pipesvc.coordinator.session``)."""


@dataclass(frozen=True, slots=True)
class RunBatch:
    """One run's micro-batches: inputs (first stage), targets (last stage, training only), side
    inputs (every stage; one mapping per micro-batch, or none at all) and, in generation, the
    caches of each micro-batch (every stage)."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor] = field(default_factory=list)
    side: list[dict[str, torch.Tensor]] = field(default_factory=list)
    caches: list[MicrobatchCaches] = field(default_factory=list)
    greedy: bool = False
    """Generation: the last stage returns each row's most likely next token, not its logits."""
    decode_steps: int = 1
    """Generation: decode steps the stages take in the run, the last stage returning
    ``[decode_steps, rows]`` tokens (see [Note: decode steps on the stages] in
    ``pipesvc.coordinator.session``)."""
    sampling: list[RowsSampling] = field(default_factory=list)
    """A run of several decode steps that is not greedy: how the last stage picks each
    session's tokens (see [Note: sampling on the last stage] there)."""

    @classmethod
    def split(
        cls,
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        side: Mapping[str, torch.Tensor] | None,
        num_microbatches: int,
    ) -> RunBatch:
        """The batch cut into ``num_microbatches`` micro-batches, every part at the same rows."""
        parts = {name: split(t, num_microbatches) for name, t in (side or {}).items()}
        return cls(
            inputs=split(inputs, num_microbatches),
            targets=split(targets, num_microbatches) if targets is not None else [],
            side=[{n: p[i] for n, p in parts.items()} for i in range(num_microbatches)]
            if parts
            else [],
        )


def replica_shares(num_microbatches: int, num_replicas: int) -> list[range]:
    """Which of a step's ``num_microbatches`` micro-batches each of ``num_replicas`` replicas
    runs: contiguous ranges in replica order, sizes differing by at most one (the first are
    the larger); a replica gets an empty range when there are fewer micro-batches."""
    base, extra = divmod(num_microbatches, num_replicas)
    shares, start = [], 0
    for replica in range(num_replicas):
        size = base + (1 if replica < extra else 0)
        shares.append(range(start, start + size))
        start += size
    return shares
