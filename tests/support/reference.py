"""The numerics oracle: the unsplit model trained in one process, and small test problems."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pipesvc import models
from pipesvc.core.microbatch import loss_weights, split


@dataclass(frozen=True)
class Problem:
    """A built-in model with small arguments and a way to make batches for it."""

    model: str
    model_args: dict[str, Any]
    loss: str
    input_shape: tuple[int, ...]
    num_classes: int = 0
    target_shape: tuple[int, ...] = field(default=())

    def batch(self, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        if self.model == "gpt":
            vocab = self.model_args["vocab_size"]
            x = torch.randint(0, vocab, (size, *self.input_shape), generator=g)
            y = torch.randint(0, vocab, (size, *self.input_shape), generator=g)
            return x, y
        x = torch.randn(size, *self.input_shape, generator=g)
        if self.loss == "mse":
            return x, torch.randn(size, *self.target_shape, generator=g)
        return x, torch.randint(0, self.num_classes, (size,), generator=g)


PROBLEMS = {
    "mlp": Problem(
        "mlp",
        {"in_features": 6, "hidden_features": 10, "out_features": 3, "num_layers": 4},
        "mse",
        (6,),
        target_shape=(3,),
    ),
    "gpt": Problem(
        "gpt",
        {"vocab_size": 17, "block_size": 8, "embed_dim": 16, "num_heads": 2, "num_blocks": 2},
        "cross_entropy",
        (8,),
    ),
    "cnn": Problem(
        "cnn",
        {"in_channels": 1, "image_size": 8, "num_classes": 5, "channels": [3, 4]},
        "cross_entropy",
        (1, 8, 8),
        num_classes=5,
    ),
}

DROPOUT_GPT = Problem(
    "gpt",
    {
        "vocab_size": 65,
        "block_size": 32,
        "embed_dim": 64,
        "num_heads": 4,
        "num_blocks": 3,
        "dropout": 0.2,
    },
    "cross_entropy",
    (32,),
)
"""A gpt with dropout: equal to the job only under ``Reference.step(..., num_microbatches)``."""


def loss_fn(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "mse":
        return F.mse_loss(output, target)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class Reference:
    """The whole model in one process, trained on whole batches, or micro-batch by micro-batch
    with each layer call seeded as the pipelined job seeds it (``models.seeded_forward``), which
    is what makes dropout's masks, and so every number, the job's."""

    def __init__(
        self,
        problem: Problem,
        *,
        seed: int,
        optimizer: Mapping[str, Any],
        clip_grad_norm: float | None,
    ) -> None:
        self.problem = problem
        self.seed = seed
        self.steps = 0
        """Committed steps; the next step is number ``steps + 1``, as in the job."""
        self.model = models.build(problem.model, seed=seed, **problem.model_args)
        kwargs = {k: v for k, v in optimizer.items() if k != "name"}
        self.optimizer = OPTIMIZERS[optimizer["name"]](self.model.parameters(), **kwargs)
        self.clip = clip_grad_norm

    def accumulated_gradients(
        self, x: torch.Tensor, y: torch.Tensor, num_microbatches: int
    ) -> dict[str, torch.Tensor]:
        """Gradients of one-process accumulation over the pipeline's micro-batches."""
        twin = copy.deepcopy(self.model)
        self._accumulate(twin, x, y, num_microbatches)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(twin.parameters(), self.clip)
        return {n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None}

    def _accumulate(
        self, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, num_microbatches: int
    ) -> float:
        """Backpropagates each micro-batch's weighted loss, layers seeded as in step
        ``steps + 1`` of the job; returns the summed loss."""
        xs, ys = split(x, num_microbatches), split(y, num_microbatches)
        total = 0.0
        weights = loss_weights([len(t) for t in xs])
        for mb, (xm, ym, w) in enumerate(zip(xs, ys, weights, strict=True)):
            out = models.seeded_forward(
                model, xm, seed=self.seed, step=self.steps + 1, microbatch=mb
            )
            loss = loss_fn(self.problem.loss, out, ym) * w
            loss.backward()
            total += float(loss.detach())
        return total

    def step(self, x: torch.Tensor, y: torch.Tensor, num_microbatches: int | None = None) -> float:
        """One training step; returns the loss. Without ``num_microbatches`` a plain
        whole-batch step (the contract for deterministic models); with it, the pipelined
        job's accumulation over its micro-batches (needed to draw its dropout masks)."""
        self.optimizer.zero_grad()
        if num_microbatches is not None:
            loss_value = self._accumulate(self.model, x, y, num_microbatches)
            return self._finish(loss_value)
        loss = loss_fn(self.problem.loss, self.model(x), y)
        loss.backward()
        return self._finish(float(loss.detach()))

    def _finish(self, loss_value: float) -> float:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.steps += 1
        return loss_value
