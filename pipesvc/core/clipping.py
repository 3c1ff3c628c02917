"""Global gradient-norm clipping over the stages of a pipeline: the sum of the stages' squared
norms and the scale it gives (no gRPC here).

[Note: norm along the links] A job that clips scales every gradient by
``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is the gradient norm over all stages. Two
places compute it and must agree bit for bit: the coordinator, from the squared norm each stage
reports with its run, and the stages themselves, when a run goes ahead of its step's decision
(see [Note: steps ahead] in ``pipesvc.coordinator.step_runner``). There, at the end of a
training run the last stage sends its squared norm up the gradient link; each stage adds its
own to what arrives and sends the sum on, so the first stage ends up with the total; the next
run carries the total down the activation links ahead of its first activation, and each stage
applies the scale before it begins. Both sides therefore add the squared norms in the same
order, from the last rank to the first (``total_norm_sq``), in float64, and derive the scale
with the same function (``clip_scale``). Each stage's own norm is computed once and both sides
add that same number, so stages of different hardware agree too.

Not with replicas: each replica's stages would compute "the same" norm independently, and on
different devices (or CPUs with other vector widths) a reduction may round differently in
the last bits, so replicas would apply different scales and drift apart. A job with replicas
therefore takes the coordinator's scale, from replica 0's norms, for every replica, and its
clipping runs do not go ahead of their step's decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

NORM_EPS = 1e-6
"""Added to the norm before dividing (as ``torch.nn.utils.clip_grad_norm_`` does)."""


def total_norm_sq(by_rank: Sequence[float]) -> float:
    """The squared global norm from each rank's squared norm (in rank order), summed from the
    last rank to the first as the links sum it."""
    total = 0.0
    for norm_sq in reversed(by_rank):
        total += norm_sq
    return total


def add_norm_sq(later: float | None, own: float) -> float:
    """One stage's step of the sum along the links: the sum of the later ranks' squared norms
    (None on the last stage) plus this stage's own, in ``total_norm_sq``'s order."""
    return (0.0 if later is None else later) + own


def clip_scale(norm_sq: float, max_norm: float) -> float:
    """The factor every gradient is multiplied by: 1 when the norm is within ``max_norm``."""
    return min(1.0, max_norm / (math.sqrt(norm_sq) + NORM_EPS))
