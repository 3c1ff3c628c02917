"""Codecs below 16 bits for activations and gradients: blockwise absmax int8 and int4.

[Note: blockwise quantization] A tensor is flattened and cut into blocks of ``block``
elements (the last one padded with zeros). Each block keeps one float32 scale, its largest
absolute value divided by the codec's largest code (127 for int8, 7 for int4), and each element
becomes ``round(x / scale)``, clamped to the codes. ``int8`` keeps a signed byte per element;
``int4`` keeps 4 bits, stored as ``code + 8`` (1..15) and packed two to a byte, the even
element in the low nibble. Decoding is ``code * scale`` in float32. A block of zeros has scale 0
and decodes to zeros; a block holding a NaN or an infinity has a NaN scale and decodes to NaNs,
as the float32 value would have poisoned the next layer anyway.

Both directions are deterministic functions of their input (round half to even, no
randomness), so the one-process reference that applies ``roundtrip`` at the same boundaries
reproduces a job's numbers exactly, and a replayed step sends the same bytes.

Bytes per element, scales included: int8 ``1 + 4 / block``, int4 ``1/2 + 4 / block``. The
default block, 64, was picked by measurement (``python bench/codecs.py --blocks``: relative RMS
error of 4096 x 256 tensors, Gaussian, ReLU, Student-t(3) and with outlier channels): int8 at 64
sends 3.76x fewer bytes than float32 with 0.6-1.7% error; 32 costs 6% more bytes for 0.5-1.2%,
128 saves 3% and lets heavy tails and outlier channels reach 1.4-2.2%.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipesvc.errors import InvalidArgumentError, WireFormatError

CODE_BITS = {"int8": 8, "int4": 4}
"""The quantizing codecs and their bits per element."""
_LARGEST = {"int8": 127, "int4": 7}
DEFAULT_BLOCK = 64
"""Elements per scale (see [Note: blockwise quantization])."""
BLOCKS = (16, 32, 64, 128, 256, 512, 1024)
"""Block sizes a packed tensor may declare."""
SCALE_BYTES = 4


def _check_codec(codec: str, block: int) -> None:
    if codec not in CODE_BITS:
        raise InvalidArgumentError(
            f"codec {codec!r} is not a quantizing codec; expected one of {sorted(CODE_BITS)}"
        )
    if block not in BLOCKS:
        raise InvalidArgumentError(f"block {block} is not supported; expected one of {BLOCKS}")


def packed_sizes(numel: int, codec: str, block: int) -> tuple[int, int]:
    """(scales, code bytes) of a tensor of ``numel`` elements packed with ``codec``."""
    _check_codec(codec, block)
    blocks = -(-numel // block)
    return blocks, blocks * block * CODE_BITS[codec] // 8


def packed_bytes(numel: int, codec: str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes a packed tensor of ``numel`` elements takes on the wire, scales included."""
    scales, codes = packed_sizes(numel, codec, block)
    return scales * SCALE_BYTES + codes


@dataclass(frozen=True, slots=True)
class Packed:
    """A tensor packed by ``quantize``: what crosses the wire besides its shape and dtype."""

    codec: str
    block: int
    shape: tuple[int, ...]
    scales: torch.Tensor
    """float32, one per block."""
    codes: torch.Tensor
    """int8 (one per element) or uint8 (two int4 codes per byte), padded to whole blocks."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def num_bytes(self) -> int:
        """Bytes on the wire: scales and codes."""
        return self.scales.numel() * SCALE_BYTES + self.codes.numel()

    def check(self) -> None:
        """Checks that the parts agree with the declared shape before anything is decoded, so
        a packed tensor can never make the receiver allocate more than its shape declares.

        Raises:
            WireFormatError: a part's dtype or size does not match the shape, codec and block.
        """
        _check_codec(self.codec, self.block)
        if any(d < 0 for d in self.shape):
            raise WireFormatError(f"packed tensor has a negative dimension in {list(self.shape)}")
        scales, code_bytes = packed_sizes(self.numel, self.codec, self.block)
        code_dtype = torch.int8 if self.codec == "int8" else torch.uint8
        if self.scales.dtype != torch.float32 or self.scales.numel() != scales:
            raise WireFormatError(
                f"packed {self.codec} tensor of shape {list(self.shape)} with block {self.block} "
                f"needs {scales} float32 scales; got {self.scales.numel()} {self.scales.dtype}"
            )
        if self.codes.dtype != code_dtype or self.codes.numel() != code_bytes:
            raise WireFormatError(
                f"packed {self.codec} tensor of shape {list(self.shape)} with block {self.block} "
                f"needs {code_bytes} bytes of {code_dtype} codes; got {self.codes.numel()} "
                f"{self.codes.dtype}"
            )


def quantize(x: torch.Tensor, codec: str, block: int = DEFAULT_BLOCK) -> Packed:
    """``x`` (floating point) packed with ``codec`` (see [Note: blockwise quantization])."""
    _check_codec(codec, block)
    if not x.is_floating_point():
        raise InvalidArgumentError(f"only floating-point tensors are quantized; got {x.dtype}")
    largest = _LARGEST[codec]
    flat = x.detach().reshape(-1).to(torch.float32)
    blocks = -(-flat.numel() // block)
    if blocks * block != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, blocks * block - flat.numel()))
    rows = flat.view(blocks, block)
    absmax = rows.abs().amax(dim=1) if blocks else rows.new_zeros(0)
    scales = torch.where(torch.isfinite(absmax), absmax / largest, torch.nan)
    safe = torch.where(torch.isfinite(scales) & (scales > 0), scales, 1.0)
    codes = torch.nan_to_num(torch.round(rows / safe[:, None]).clamp_(-largest, largest), 0.0)
    if codec == "int8":
        packed = codes.to(torch.int8).reshape(-1)
    else:
        nibbles = (codes.to(torch.int16) + 8).to(torch.uint8).reshape(-1, 2)
        packed = (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous()
    return Packed(codec, block, tuple(x.shape), scales.contiguous(), packed)


def dequantize(packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor ``packed`` stands for, in ``dtype`` (after ``Packed.check``)."""
    packed.check()
    if packed.codec == "int8":
        codes = packed.codes.to(torch.float32)
    else:
        low = (packed.codes & 0x0F).to(torch.int16) - 8
        high = (packed.codes >> 4).to(torch.int16) - 8
        codes = torch.stack((low, high), dim=1).reshape(-1).to(torch.float32)
    rows = codes.view(-1, packed.block) * packed.scales[:, None]
    return rows.reshape(-1)[: packed.numel].reshape(packed.shape).to(dtype)


def roundtrip(x: torch.Tensor, codec: str, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """What a receiver decodes from ``x`` sent with ``codec`` (a quantizing codec, or a float
    dtype's name such as ``"bfloat16"``), in ``x``'s dtype."""
    if codec in CODE_BITS:
        return dequantize(quantize(x, codec, block), x.dtype)
    return x.to(getattr(torch, codec)).to(x.dtype)


class _ThroughWire(torch.autograd.Function):
    """Identity up to the codecs: forward sends the value with one, backward the gradient
    with the other (None: exact)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        activations: str | None,
        gradients: str | None,
        block: int,
    ) -> torch.Tensor:
        ctx.gradients = gradients  # type: ignore[attr-defined]
        ctx.block = block  # type: ignore[attr-defined]
        return roundtrip(x, activations, block) if activations else x.clone()

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        codec: str | None = ctx.gradients  # type: ignore[attr-defined]
        block: int = ctx.block  # type: ignore[attr-defined]
        return (roundtrip(grad, codec, block) if codec else grad), None, None, None


def through_wire(
    x: torch.Tensor,
    activations: str | None,
    gradients: str | None,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """``x`` as the next stage sees it after a link whose codecs are ``activations`` (the
    value) and ``gradients`` (its gradient on the way back): the one-process reference of
    [Note: blockwise quantization] at a stage boundary."""
    result: torch.Tensor = _ThroughWire.apply(  # type: ignore[no-untyped-call]
        x, activations, gradients, block
    )
    return result
