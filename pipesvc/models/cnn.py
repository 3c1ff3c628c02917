"""The built-in ``cnn`` model: Conv-ReLU-MaxPool layers, a Flatten layer and a Linear classifier.

Usage::

    from pipesvc import models

    net = models.build("cnn", seed=0, in_channels=1, image_size=16, channels=[8, 16])
    logits = net(torch.randn(4, 1, 16, 16))  # (4, 10)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.registry import LayerSpec, register_model


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    """(B, in, H, W) -> (B, out, H/2, W/2)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


@register_model("cnn")
def cnn(
    in_channels: int = 1,
    image_size: int = 16,
    num_classes: int = 10,
    channels: Sequence[int] | None = None,
) -> list[LayerSpec]:
    """Returns the layers of a small image classifier; input ``(B, in_channels, H, H)``.

    Args:
        in_channels: Channels of the input images.
        image_size: Height and width of the (square) input images.
        num_classes: Number of output logits.
        channels: Output channels of each conv layer; ``None`` means ``[8, 16]``.

    Raises:
        InvalidArgumentError: a size is not a positive integer, or ``image_size`` is not
            divisible by ``2 ** len(channels)``.
    """
    channels = [8, 16] if channels is None else channels
    if not isinstance(channels, list | tuple) or not channels:
        raise InvalidArgumentError(f"cnn: channels ({channels!r}) must be a non-empty list")
    sizes: dict[str, object] = {
        "in_channels": in_channels,
        "image_size": image_size,
        "num_classes": num_classes,
    }
    sizes.update({f"channels[{i}]": c for i, c in enumerate(channels)})
    for key, value in sizes.items():
        if type(value) is not int or value <= 0:
            raise InvalidArgumentError(f"cnn: {key} ({value!r}) must be a positive integer")
    reduction = 2 ** len(channels)
    if image_size % reduction:
        raise InvalidArgumentError(
            f"cnn: image_size ({image_size}) must be divisible by 2**len(channels) ({reduction})"
        )
    widths = [in_channels, *channels]
    specs = [LayerSpec(_conv_block, a, b) for a, b in itertools.pairwise(widths)]
    side = image_size // reduction
    specs.append(LayerSpec(nn.Flatten))
    specs.append(LayerSpec(nn.Linear, widths[-1] * side * side, num_classes))
    return specs
