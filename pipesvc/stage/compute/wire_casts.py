"""How activations and gradients cross a stage's links: the codecs in and out, and the casts
on arrival (no gRPC here).

[Note: wire dtype] ``JobConfig.wire_dtype`` sends activations and gradients between stages in
a codec of their own, per role (``JobConfig.wire_codecs``), under any precision: a stage encodes
its output (and, in backward, its input's gradient) before sending, and the receiver decodes
it. A float codec (bfloat16, float16) is a cast: the receiver casts an arriving activation back
to its compute dtype (float32, or bfloat16 under ``bf16``; under ``bf16-mixed`` autocast takes
it as it is) and a gradient to its output's dtype. A quantizing codec (int8, int4) sends every
tensor as a packed blob (see [Note: packed blob] in ``pipesvc.core.quant``) that the receiver
decodes to the dtype it was sent in. The numbers are those of one process that runs
``quant.through_wire(t, activations, gradients)`` on each boundary's activation (for a float
codec on both roles that is ``t.to(wire).to(compute)``, through which autograd casts the
gradient the same way). float16 keeps 10 bits of mantissa against bfloat16's 7 but only 5 of
exponent: gradients below about 6e-8 flush to zero (no loss scaling here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipesvc.core import quant
from pipesvc.core.config import JobConfig
from pipesvc.core.link_codecs import Codecs
from pipesvc.errors import InvalidArgumentError, WireFormatError


@dataclass(frozen=True, slots=True)
class WireCasts:
    """A stage's codecs on its links in and out, and what forward casts on arrival."""

    up: Codecs
    """(activations, gradients) codecs of the link from the previous stage."""
    down: Codecs
    """(activations, gradients) codecs of the link to the next stage."""
    cast_always: bool
    """Forward casts every floating-point input to the compute dtype (bf16 weights, or a
    quantized codec outside autocast)."""
    cast_from: torch.dtype | None
    """Else forward casts an input arriving in this dtype (a float codec's; None: never)."""
    profile_wire: str | None
    """The codec activations leave in, for the profiler's bytes."""

    @classmethod
    def of(cls, config: JobConfig, links: tuple[Codecs, Codecs] | None) -> WireCasts:
        """The casts of a stage of ``config`` whose links have ``links`` (see [Note: codecs per
        link]); without a plan, the job's codecs on both."""
        up, down = links or (config.wire_codecs, config.wire_codecs)
        act = up[0]
        autocast = config.precision == "bf16-mixed"
        wire_float = getattr(torch, act) if act is not None and act not in quant.CODE_BITS else None
        return cls(
            up=up,
            down=down,
            cast_always=config.precision == "bf16" or (act in quant.CODE_BITS and not autocast),
            cast_from=None if autocast else wire_float,
            profile_wire=config.wire_codecs[0],
        )


def to_wire(t: torch.Tensor, codec: str | None) -> torch.Tensor:
    """What is sent to a neighbour with ``codec`` (see [Note: wire dtype])."""
    if codec is None:
        return t
    if codec in quant.CODE_BITS:
        return quant.to_blob(t.detach(), codec)  # every tensor: see [Note: packed blob]
    return t.detach().to(getattr(torch, codec)) if t.is_floating_point() else t


def from_wire(t: torch.Tensor, codec: str | None) -> torch.Tensor:
    """What a neighbour sent with ``codec``, as it stands (a quantized one decoded).

    Raises:
        InvalidArgumentError: a quantized blob that does not decode.
    """
    if codec is None or codec not in quant.CODE_BITS:
        return t
    try:
        return quant.from_blob(t)
    except WireFormatError as exc:
        raise InvalidArgumentError(f"a tensor from a neighbour stage: {exc}") from exc
