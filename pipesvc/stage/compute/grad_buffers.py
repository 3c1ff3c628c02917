"""A stage's gradient buffers, reused from run to run (no gRPC here).

[Note: gradient buffers] A training run zeroes the previous step's gradients in place rather
than dropping them (``zero_grad(set_to_none=True)``) and allocating new ones in backward. On
glibc before 2.38 a freed block of exactly a tensor's size is too small for the next
``posix_memalign`` of that size (torch aligns CPU tensors to 64 bytes, and glibc asks for the
size plus the alignment), so dropped gradients would stay resident as holes beside their
replacements; reusing the buffers also spares the page faults of fresh memory. A parameter that
gets no gradient in a run still ends it with ``grad`` None, as after
``zero_grad(set_to_none=True)``, so the optimizer skips it: ``GradBuffers.settle`` drops the buffers
that no backward has added to since they were zeroed (their version counter is unchanged). The
sums are those of fresh buffers, since ``0 + g`` is ``g``.
"""

from __future__ import annotations

import torch
from torch import nn


class GradBuffers:
    """The gradient buffers a training run zeroed, to tell which it added to."""

    def __init__(self) -> None:
        self._zeroed: list[tuple[nn.Parameter, torch.Tensor, int]] = []

    def zero(self, module: nn.Module) -> None:
        """Zeroes ``module``'s gradient buffers in place for a run to accumulate into."""
        self._zeroed = []
        for p in module.parameters():
            grad = p.grad
            if grad is None:
                continue
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
            grad.zero_()
            self._zeroed.append((p, grad, grad._version))

    def settle(self) -> None:
        """Drops the zeroed buffers that no backward of the run accumulated into."""
        for p, grad, version in self._zeroed:
            if p.grad is grad and grad._version == version:
                p.grad = None
        self._zeroed = []

    def forget(self) -> None:
        """Forgets the zeroed buffers (their run was aborted or its job released)."""
        self._zeroed = []
