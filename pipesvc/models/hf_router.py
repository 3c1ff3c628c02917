"""A mixture-of-experts model's load-balancing loss across stages.

[Note: the router's auxiliary loss] When a config asks for it (``output_router_logits`` true and
a non-zero ``router_aux_loss_coef``), ``transformers`` adds to the loss

    coef * E * sum_e (counts_e / rows) * (probabilities_e / rows)

where, over every router layer of the model and every (unpadded) token, ``counts_e`` counts the
tokens routed to expert ``e`` among their top ``k`` and ``probabilities_e`` sums the router's
softmax for ``e``; ``rows`` is the number of (layer, token) pairs. Its gradient reaches each
router through ``probabilities``, scaled by the counts of *all* layers, which one stage does not
have. So the model carries ``[counts, probabilities, rows]`` (``2E + 1`` floats) through the
pipeline beside the hidden states (see [Note: carried vector] in ``pipesvc.models.carry``): each
block adds its router's terms, in layer order from zeros exactly as ``transformers``'
``load_balancing_loss_func`` accumulates them, and the last stage adds the loss.

What it equals: the loss is computed per micro-batch and weighted like the rest of the
micro-batch's loss, so a step of one micro-batch equals ``transformers``' ``model(ids,
attention_mask=mask, labels=labels).loss``, and a step of several equals each micro-batch's
``transformers`` loss weighted by its share of the labels (gradient accumulation, as
``transformers``' Trainer does it). Registration checks that the family's own
``load_balancing_loss_func`` computes what the carried sums give; a family whose function
differs is refused.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.carry import CarrySpec


@dataclass(frozen=True)
class RouterLoss:
    """What a model's load-balancing loss needs: its experts, top ``k``, coefficient, and
    which module's output (at which index) are the router's logits."""

    num_experts: int
    top_k: int
    coef: float
    router: type[nn.Module]
    index: int

    @property
    def size(self) -> int:
        """Floats carried: counts and probability sums per expert, then the rows."""
        return 2 * self.num_experts + 1

    def carry(self) -> CarrySpec:
        return CarrySpec(size=self.size, loss=functools.partial(aux_loss, self))


def router_loss_of(model: nn.Module, where: str) -> RouterLoss | None:
    """The load-balancing loss ``model`` (a ``*ForCausalLM``) adds when its config asks for it;
    None when it does not ask.

    Raises:
        InvalidArgumentError: the config asks for it, but the family's code does not compute
            it in the form pipesvc carries across stages (``where`` names the model).
    """
    config = model.config
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or coef == 0.0:
        return None
    recorded = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorded.get("router_logits")
    module = sys.modules.get(type(model).__module__)
    reference = getattr(module, "load_balancing_loss_func", None)
    experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    if (
        recorder is None
        or getattr(recorder, "target_class", None) is None
        or reference is None
        or not isinstance(experts, int)
        or not isinstance(top_k, int)
    ):
        raise InvalidArgumentError(
            f"{where}: config.json asks for the router's auxiliary loss (output_router_logits: "
            f"true, router_aux_loss_coef: {coef}), but {type(model).__name__} does not record "
            "router logits and compute load_balancing_loss_func as pipesvc carries it across "
            "stages; set output_router_logits to false"
        )
    found = RouterLoss(experts, top_k, coef, recorder.target_class, int(recorder.index))
    _check_same(found, reference, where)
    return found


def _check_same(loss: RouterLoss, reference: Any, where: str) -> None:
    """Refuses a family whose ``load_balancing_loss_func`` differs from the carried sums, on
    random logits of three layers with and without a padding mask."""
    with torch.device("cpu"):  # also when called while layers are built on meta
        g = torch.Generator().manual_seed(0)
        logits = [torch.randn(6, loss.num_experts, generator=g) for _ in range(3)]
        for given in (None, torch.tensor([[0, 1, 1], [1, 1, 1]])):
            total = torch.zeros(loss.size)
            for layer in logits:
                total = total + statistics(loss, layer, given)
            ours = aux_loss(loss, total) / loss.coef
            theirs = reference(tuple(logits), loss.num_experts, loss.top_k, given)
            if not torch.allclose(ours, torch.as_tensor(theirs, dtype=ours.dtype), rtol=1e-5):
                raise InvalidArgumentError(
                    f"{where}: config.json asks for the router's auxiliary loss, but this "
                    f"family's load_balancing_loss_func gives {float(theirs):.6g} where the "
                    f"per-layer sums pipesvc carries across stages give {float(ours):.6g}; set "
                    "output_router_logits to false"
                )


def statistics(
    loss: RouterLoss, logits: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """One router layer's terms ``[counts, probabilities, rows]`` for logits ``[rows, E]``
    (tokens flattened as the router sees them) and the batch's ``[B, T]`` padding mask."""
    experts = loss.num_experts
    weights = F.softmax(logits, dim=-1)
    _, chosen = torch.topk(weights, loss.top_k, dim=-1)
    if attention_mask is None:
        counts = torch.histc(chosen.reshape(-1).to(torch.float32), bins=experts, min=0, max=experts)
        probabilities = weights.float().sum(dim=0)
        rows = torch.tensor([float(weights.shape[0])], device=logits.device)
    else:
        flat = attention_mask.reshape(-1).to(device=logits.device, dtype=torch.float32)
        counts = torch.zeros(experts, dtype=torch.float32, device=logits.device).scatter_add_(
            0, chosen.reshape(-1), flat.repeat_interleave(loss.top_k)
        )
        probabilities = (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
        rows = flat.sum().reshape(1)
    return torch.cat([counts.detach(), probabilities, rows.detach()])


def aux_loss(loss: RouterLoss, total: torch.Tensor) -> torch.Tensor:
    """``coef`` times the load-balancing loss of the carried total."""
    experts = loss.num_experts
    rows = total[2 * experts]
    per_expert = total[:experts] / rows
    probability = total[experts : 2 * experts] / rows
    overall = torch.sum(per_expert * probability.unsqueeze(0)) * experts
    return loss.coef * overall


class RouterTap:
    """Records the router logits of one decoder block's forward (hooks on its routers)."""

    def __init__(self, block: nn.Module, loss: RouterLoss) -> None:
        self.loss = loss
        self.found: list[torch.Tensor] | None = None
        self.routers = [m for m in block.modules() if isinstance(m, loss.router)]
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.found is not None:
            out = output[self.loss.index] if isinstance(output, Sequence) else output
            self.found.append(out)

    def start(self) -> None:
        self.found = []

    def terms(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The block's terms, in the order its routers ran; None when none ran."""
        found, self.found = self.found, None
        if not found:
            return None
        total = statistics(self.loss, found[0], attention_mask)
        for logits in found[1:]:
            total = total + statistics(self.loss, logits, attention_mask)
        return total
