"""The carried vectors of a stage's training micro-batches in flight (see [Note: carried vector]
in ``pipesvc.models.carry``): where each starts, its total to send on, its loss term, and the
gradient of its start to send back (no gRPC here)."""

from __future__ import annotations

import torch

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.carry import CarrySpec, check_carried


class CarriedVectors:
    """A stage's carried vectors by micro-batch key (a micro-batch's chunk, see
    ``StageRuntime``): each one's start and total from its forward to its backward, then its
    start's gradient until it is sent."""

    def __init__(
        self,
        spec: CarrySpec | None,
        *,
        model: str,
        chunks: list[tuple[int, int]],
        device: torch.device,
    ) -> None:
        self.spec = spec
        """The model's carried vector; None when it carries none."""
        self._model = model
        self._chunks = chunks
        self._device = device
        self._in_flight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grads: dict[int, torch.Tensor] = {}

    def start(self, carry: torch.Tensor | None, *, first: bool, chunk: int) -> torch.Tensor | None:
        """A training micro-batch's carried vector as this stage's layers of ``chunk`` start
        from it: zeros on the first stage, else what the stage before sent (``carry``), as a
        leaf for its gradient; None when the model carries none.

        Raises:
            InvalidArgumentError: no vector, or not one of the model's size, from the stage
                before.
        """
        spec = self.spec
        if spec is None:
            return None
        if first:
            return torch.zeros(spec.size, dtype=torch.float32, device=self._device)
        if carry is None:
            raise InvalidArgumentError(
                f"model {self._model!r} carries a vector of {spec.size} into layer "
                f"{self._chunks[chunk][0]}; none arrived"
            )
        check_carried(carry, spec, f"the carried vector into layer {self._chunks[chunk][0]}")
        return carry.to(self._device).detach().requires_grad_(True)

    def keep(self, key: int, start: torch.Tensor, total: torch.Tensor) -> None:
        """Keeps a forward's start and total until the backward of micro-batch ``key``."""
        self._in_flight[key] = (start, total)

    def total(self, key: int) -> torch.Tensor | None:
        """The carried total of micro-batch ``key``'s forward, to send to the next stage."""
        found = self._in_flight.get(key)
        return None if found is None else found[1].detach()

    def with_loss(self, key: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus the loss term of micro-batch ``key``'s carried total, if it has one."""
        carried = self._in_flight.get(key)
        if carried is not None and self.spec is not None:
            return loss + self.spec.loss(carried[1])
        return loss

    def pop(self, key: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Micro-batch ``key``'s start and total, for its backward; None if it carries none."""
        return self._in_flight.pop(key, None) if self._in_flight else None

    def backward(
        self,
        y: torch.Tensor,
        grad_output: torch.Tensor | None,
        carried: tuple[torch.Tensor, torch.Tensor],
        carry_grad: torch.Tensor | None,
        *,
        chunk: int,
        last: bool,
    ) -> None:
        """Backward from the output ``y`` and, before the last virtual stage (``last``), from
        the carried total too, with ``carry_grad`` from the stage after.

        Raises:
            InvalidArgumentError: the carried total's gradient is missing or malformed.
        """
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if y.requires_grad:
            roots.append(y)
            grads.append(
                None if grad_output is None else grad_output.to(device=self._device, dtype=y.dtype)
            )
        total = carried[1]
        spec = self.spec
        if not last and total.requires_grad and spec is not None:
            if carry_grad is None:
                raise InvalidArgumentError(
                    f"no gradient arrived for the vector carried out of layer "
                    f"{self._chunks[chunk][1] - 1}"
                )
            check_carried(carry_grad, spec, "the carried vector's gradient")
            roots.append(total)
            grads.append(carry_grad.to(self._device))
        torch.autograd.backward(roots, grads)

    def keep_grad(self, key: int, start: torch.Tensor) -> None:
        """After micro-batch ``key``'s backward: keeps its start's gradient (zeros when none
        reached it) until it is sent to the stage before."""
        found = start.grad
        self._grads[key] = found if found is not None else torch.zeros_like(start)

    def pop_grad(self, key: int) -> torch.Tensor | None:
        """The gradient of micro-batch ``key``'s start, once its backward ran; None before."""
        return self._grads.pop(key, None)

    def clear(self) -> None:
        """Forgets every micro-batch's vectors (the run ended, or was dropped)."""
        self._in_flight.clear()
        self._grads.clear()
