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

from pipesvc.core.tensor_codec import torch_dtype, wire_dtype
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


def wire_bytes(numel: int, codec: str) -> int:
    """Bytes ``numel`` floating-point elements take on a link with ``codec`` (a quantizing
    codec, scales included and blob head left out, or a float dtype's name)."""
    if codec in CODE_BITS:
        return packed_bytes(numel, codec)
    return numel * torch.empty((), dtype=getattr(torch, codec)).element_size()


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


# -- one tensor on a link -----------------------------------------------------------------------
#
# [Note: packed blob] On a link whose codec quantizes, every tensor crosses as one uint8 tensor
# that describes itself, so the links, frames and shared memory carry it unchanged: an 8-byte
# head (magic ``PQ``, version, kind, log2 of the block, dtype as common.proto's DType,
# number of dimensions, zero),
# each dimension as an int64, then for a quantized tensor its float32 scales and its codes, and
# for a tensor that is not quantized (not floating point) its bytes as they are. The receiver
# checks the head and that the declared shape accounts for every byte before it decodes
# anything, so a blob can never make it allocate more than its declared shape.

_MAGIC = b"PQ"
_VERSION = 1
_HEAD = 8
_KINDS = ("raw", "int8", "int4")
MAX_BLOB_DIMS = 8


def to_blob(x: torch.Tensor, codec: str, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``x`` as the uint8 tensor, in host memory, that a link with ``codec`` carries (see
    [Note: packed blob]): quantized when floating point, as it is otherwise."""
    try:
        dtype = wire_dtype(x.dtype)  # the DType enum value of common.proto
    except WireFormatError as exc:
        raise InvalidArgumentError(str(exc)) from None
    if x.dim() > MAX_BLOB_DIMS:
        raise InvalidArgumentError(
            f"a tensor with {x.dim()} dimensions cannot cross a link; at most {MAX_BLOB_DIMS}"
        )
    quantized = x.is_floating_point()
    kind = _KINDS.index(codec) if quantized else 0
    head = bytearray(_MAGIC)
    head += bytes((_VERSION, kind, block.bit_length() - 1, dtype, x.dim(), 0))
    dims = torch.tensor(list(x.shape), dtype=torch.int64).view(torch.uint8)
    parts = [torch.frombuffer(head, dtype=torch.uint8), dims]
    if quantized:
        packed = quantize(x, codec, block)  # on x's device; what crosses is in host memory
        parts += [packed.scales.cpu().view(torch.uint8), packed.codes.cpu().view(torch.uint8)]
    else:
        parts.append(x.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def from_blob(blob: torch.Tensor, max_elements: int = 1 << 31) -> torch.Tensor:
    """The tensor a blob made by ``to_blob`` stands for (a dequantized float keeps its sent
    dtype; the caller casts it to its compute dtype).

    Raises:
        WireFormatError: the blob is not one, or its parts do not match its declared shape.
    """
    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() < _HEAD:
        raise WireFormatError(
            f"expected a packed tensor (1-D uint8 of at least {_HEAD} bytes) on a link whose "
            f"codec quantizes; got {blob.dtype} of shape {list(blob.shape)}"
        )
    head = bytes(blob[:_HEAD].tolist())
    version, kind, log_block, dtype, ndim = head[2], head[3], head[4], head[5], head[6]
    if head[:2] != _MAGIC or version != _VERSION or kind >= len(_KINDS):
        raise WireFormatError(f"packed tensor has a bad head {head.hex()}")
    target = torch_dtype(dtype)
    if ndim > MAX_BLOB_DIMS or blob.numel() < _HEAD + 8 * ndim:
        raise WireFormatError(f"packed tensor declares {ndim} dimensions in {blob.numel()} bytes")
    shape = tuple(blob[_HEAD : _HEAD + 8 * ndim].clone().view(torch.int64).tolist())
    if any(d < 0 for d in shape):
        raise WireFormatError(f"packed tensor declares a negative dimension in {list(shape)}")
    numel = 1
    for d in shape:
        numel *= d
    if numel > max_elements:
        raise WireFormatError(
            f"packed tensor declares {numel} elements; at most {max_elements} are accepted"
        )
    body = blob[_HEAD + 8 * ndim :]
    if _KINDS[kind] == "raw":
        size = torch.empty((), dtype=target).element_size()
        if body.numel() != numel * size:
            raise WireFormatError(
                f"packed {target} tensor of shape {list(shape)} needs {numel * size} bytes; "
                f"got {body.numel()}"
            )
        return body.clone().view(target).reshape(shape)
    codec, block = _KINDS[kind], 1 << log_block
    if block not in BLOCKS or not target.is_floating_point:
        raise WireFormatError(f"packed tensor declares block {block} and dtype {target}")
    scales, code_bytes = packed_sizes(numel, codec, block)
    if body.numel() != scales * SCALE_BYTES + code_bytes:
        raise WireFormatError(
            f"packed {codec} tensor of shape {list(shape)} with block {block} needs "
            f"{scales * SCALE_BYTES + code_bytes} bytes; got {body.numel()}"
        )
    scale_part = body[: scales * SCALE_BYTES].clone().view(torch.float32)
    code_part = body[scales * SCALE_BYTES :]
    codes = code_part.view(torch.int8) if codec == "int8" else code_part
    return dequantize(Packed(codec, block, shape, scale_part, codes), target)
