"""A vector a model carries through the pipeline beside its activations.

[Note: carried vector] Some losses need statistics of every layer of a micro-batch, not only the
last layer's output: a mixture-of-experts model's load-balancing loss sums each router's token
counts and probabilities over all layers. A model with such a loss declares a ``CarrySpec``.
In a training run each micro-batch then has a float32 vector of ``size`` beside its
activations:

- the first stage starts it at zeros; each layer that sets ``adds_to_carry`` receives it as a
  ``Carry`` (keyword ``carry``) and adds its term, in layer order;
- it travels to the next stage with the activation (part 1 of the micro-batch's frames in that
  direction, never through a wire codec);
- the last stage adds ``spec.loss(total)`` to the micro-batch's loss, before the loss weight;
- in backward, its gradient travels back with the activation's gradient, so every stage's
  terms (and, through them, the hidden states they were computed from) get their gradients.

The sum is formed in the order one process would form it, layer after layer from zeros, so a
pipelined step equals one process bit for bit. Inference and generation carry nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipesvc.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class CarrySpec:
    """A model's carried vector: its length and the loss term made from its total."""

    size: int
    loss: Callable[[torch.Tensor], torch.Tensor]
    """The carried total (a float32 vector of ``size``) -> the scalar added to the loss."""


class Carry:
    """One micro-batch's carried vector while a stage's layers run; layers ``add`` to it."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def add(self, term: torch.Tensor) -> None:
        self.value = self.value + term


def check_carried(value: torch.Tensor, spec: CarrySpec, what: str) -> None:
    """Checks a carried vector (or its gradient) that arrived from a neighbour.

    Raises:
        InvalidArgumentError: not a float32 vector of ``spec.size``.
    """
    if value.dtype != torch.float32 or tuple(value.shape) != (spec.size,):
        raise InvalidArgumentError(
            f"{what} has shape {list(value.shape)} and dtype {value.dtype}; expected a float32 "
            f"vector of {spec.size}"
        )
