"""The built-in ``mlp`` model: ``num_layers - 1`` blocks of Linear + ReLU, then a Linear.

Usage::

    from pipesvc import models

    net = models.build("mlp", seed=0, in_features=16, hidden_features=32, out_features=8)
    y = net(torch.randn(4, 16))  # (4, 8)
"""

from __future__ import annotations

import itertools

from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.registry import LayerSpec, register_model


def _block(in_features: int, out_features: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU())


@register_model("mlp")
def mlp(
    in_features: int = 16, hidden_features: int = 32, out_features: int = 8, num_layers: int = 4
) -> list[LayerSpec]:
    """Returns the layers of a multi-layer perceptron; input ``(B, in_features)``.

    Raises:
        InvalidArgumentError: a size or count is not a positive integer.
    """
    sizes = {
        "in_features": in_features,
        "hidden_features": hidden_features,
        "out_features": out_features,
        "num_layers": num_layers,
    }
    for key, value in sizes.items():
        if type(value) is not int or value <= 0:
            raise InvalidArgumentError(f"mlp: {key} ({value!r}) must be a positive integer")
    widths = [in_features] + [hidden_features] * (num_layers - 1)
    specs = [LayerSpec(_block, a, b) for a, b in itertools.pairwise(widths)]
    specs.append(LayerSpec(nn.Linear, widths[-1], out_features))
    return specs
