"""The gradients of tied parameters on a stage: summed over the copies here and, for a group
shared with another stage, with that stage's sum (see [Note: tied parameters] in
``pipesvc.core.tying``; no gRPC here)."""

from __future__ import annotations

import torch
from torch import nn

from pipesvc.core.tying import StageTies
from pipesvc.errors import InvalidArgumentError


class TiedGrads:
    """A stage's tied groups that train, and their partial sums between a run's last backward
    and ``settle``."""

    def __init__(self, ties: StageTies) -> None:
        self.ties = ties
        self._partials: dict[int, torch.Tensor] = {}

    def partials(self, module: nn.Module) -> dict[int, torch.Tensor]:
        """Each tied group's gradient summed over its copies in ``module``; returns those of
        the groups shared with another stage (to swap with it, then ``settle``)."""
        params = dict(module.named_parameters())
        self._partials = {}
        for group, keys in self.ties.local.items():
            partial = torch.zeros_like(params[keys[0]])
            for grad in (params[k].grad for k in keys):
                if grad is not None:
                    partial += grad
            self._partials[group] = partial
        return {g: self._partials[g] for g in self.ties.peers}

    def settle(self, module: nn.Module, theirs: dict[int, torch.Tensor]) -> None:
        """Gives every tied copy in ``module`` its group's total: this stage's partial plus the
        other stage's (``theirs``, for groups shared with one).

        Raises:
            InvalidArgumentError: ``theirs`` lacks a shared group or does not match its shape.
        """
        params = dict(module.named_parameters())
        for group, keys in self.ties.local.items():
            total = self._partials[group]
            if group in self.ties.peers:
                other = theirs.get(group)
                if other is None or other.shape != total.shape:
                    raise InvalidArgumentError(
                        f"tied group {group}: expected a gradient of shape {list(total.shape)} "
                        f"from rank {self.ties.peers[group]}; got "
                        f"{None if other is None else list(other.shape)}"
                    )
                total = total + other.to(device=total.device, dtype=total.dtype)
            for key in keys:
                p = params[key]
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)
        self._partials = {}

    def forget(self) -> None:
        """Drops the partial sums (the job was released)."""
        self._partials = {}
