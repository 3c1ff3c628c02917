"""Blockwise int8 and int4 codecs (pipesvc.core.quant)."""

from __future__ import annotations

import math

import pytest
import torch

from pipesvc.core import quant
from pipesvc.errors import InvalidArgumentError, WireFormatError


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(4096, 256), (3, 5, 7), (1,), (0, 4), (65,)])
def test_round_trip_error_is_bounded_by_half_a_step_per_block(
    codec: str, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    packed = quant.quantize(x, codec)
    packed.check()
    y = quant.dequantize(packed)
    assert y.shape == x.shape and y.dtype == torch.float32
    if not x.numel():
        return
    largest = 127 if codec == "int8" else 7
    flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % quant.DEFAULT_BLOCK))
    step = flat.view(-1, quant.DEFAULT_BLOCK).abs().amax(1) / largest
    bound = step.repeat_interleave(quant.DEFAULT_BLOCK)[: x.numel()] / 2 + 1e-6
    assert bool(((y - x).reshape(-1).abs() <= bound).all())
    # The largest element of each block is exact (up to float32 rounding of the scale).
    i = x.reshape(-1).abs().argmax()
    assert math.isclose(float(y.reshape(-1)[i]), float(x.reshape(-1)[i]), rel_tol=1e-6)


def test_sizes_on_the_wire_match_the_formula_and_the_goal() -> None:
    x = torch.randn(4096, 256)
    p8 = quant.quantize(x, "int8")
    p4 = quant.quantize(x, "int4")
    assert p8.num_bytes == quant.packed_bytes(x.numel(), "int8") == x.numel() * (1 + 4 / 64)
    assert p4.num_bytes == quant.packed_bytes(x.numel(), "int4") == x.numel() * (0.5 + 4 / 64)
    assert x.numel() * 4 / p8.num_bytes >= 3.5  # issue's goal: int8 >= 3.5x fewer than fp32


def test_int4_packs_two_codes_per_byte_low_nibble_first() -> None:
    x = torch.zeros(64)
    x[0], x[1], x[2] = 7.0, -7.0, 1.0  # scale 1: codes 7, -7, 1 -> stored 15, 1, 9
    packed = quant.quantize(x, "int4")
    assert packed.codes.dtype == torch.uint8 and packed.codes.numel() == 32
    assert int(packed.codes[0]) == 15 | (1 << 4)
    assert int(packed.codes[1]) == 9 | (8 << 4)
    assert torch.equal(quant.dequantize(packed), x)


def test_zero_blocks_decode_to_zero_and_non_finite_blocks_to_nan_without_touching_others() -> None:
    x = torch.randn(256)
    x[:64] = 0
    x[64] = float("inf")
    x[130] = float("nan")
    for codec in ("int8", "int4"):
        y = quant.dequantize(quant.quantize(x, codec))
        assert bool((y[:64] == 0).all())
        assert bool(y[64:192].isnan().all())
        assert bool(y[192:].isfinite().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_roundtrip_keeps_the_dtype_and_is_deterministic(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(33, 17).to(dtype)
    for codec in ("int8", "int4", "bfloat16", "float16"):
        a = quant.roundtrip(x, codec)
        b = quant.roundtrip(x.clone(), codec)
        assert a.dtype == dtype and torch.equal(a, b)


def test_through_wire_applies_one_codec_forward_and_the_other_backward() -> None:
    torch.manual_seed(2)
    x = torch.randn(8, 64, requires_grad=True)
    g = torch.randn(8, 64)
    y = quant.through_wire(x, "int8", "int4")
    assert torch.equal(y, quant.roundtrip(x.detach(), "int8"))
    (grad,) = torch.autograd.grad(y, x, g)
    assert torch.equal(grad, quant.roundtrip(g, "int4"))
    (exact,) = torch.autograd.grad(quant.through_wire(x, None, None), x, g)
    assert torch.equal(exact, g)


def test_bad_codec_block_or_dtype_is_refused_with_the_value_named() -> None:
    with pytest.raises(InvalidArgumentError, match="'int3'"):
        quant.quantize(torch.randn(4), "int3")
    with pytest.raises(InvalidArgumentError, match="block 48"):
        quant.quantize(torch.randn(4), "int8", 48)
    with pytest.raises(InvalidArgumentError, match=r"torch\.int64"):
        quant.quantize(torch.arange(4), "int8")


def test_packed_parts_that_disagree_with_the_shape_are_refused_before_decoding() -> None:
    good = quant.quantize(torch.randn(128), "int8")
    for bad in (
        quant.Packed("int8", 64, (1 << 40,), good.scales, good.codes),  # huge declared shape
        quant.Packed("int8", 64, (128,), good.scales[:1], good.codes),
        quant.Packed("int8", 64, (128,), good.scales.double(), good.codes),
        quant.Packed("int8", 64, (128,), good.scales, good.codes[:-1]),
        quant.Packed("int4", 64, (128,), good.scales, good.codes),  # int8 codes as int4
        quant.Packed("int8", 64, (-1, 128), good.scales, good.codes),
    ):
        with pytest.raises(WireFormatError):
            quant.dequantize(bad)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize(
    "x",
    [
        torch.randn(5, 7, 3),
        torch.randn(2, 3).bfloat16(),
        torch.randn(0, 4),
        torch.arange(12).view(3, 4),
        torch.tensor([True, False]),
        torch.randint(0, 255, (9,), dtype=torch.uint8),
    ],
    ids=["float32", "bfloat16", "empty", "int64", "bool", "uint8"],
)
def test_a_blob_stands_for_its_tensor(codec: str, x: torch.Tensor) -> None:
    blob = quant.to_blob(x, codec)
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    back = quant.from_blob(blob)
    assert back.dtype == x.dtype and back.shape == x.shape
    expected = quant.roundtrip(x, codec) if x.is_floating_point() else x
    assert torch.equal(back, expected)


def test_a_blob_is_no_bigger_than_its_packed_tensor_and_a_head() -> None:
    x = torch.randn(4096, 256)
    blob = quant.to_blob(x, "int8")
    assert blob.numel() == 8 + 2 * 8 + quant.packed_bytes(x.numel(), "int8")


def test_malformed_blobs_are_refused_before_anything_is_allocated() -> None:
    good = quant.to_blob(torch.randn(4, 64), "int8")
    huge = good.clone()
    huge[8:16] = torch.tensor([1 << 40], dtype=torch.int64).view(torch.uint8)
    bad_magic = good.clone()
    bad_magic[0] = 0
    for bad in (
        good[:-1],  # a code missing
        torch.cat([good, good[:4]]),  # bytes beyond the declared shape
        huge,  # a shape far beyond the bytes sent
        bad_magic,
        good[:5],  # shorter than a head
        good.view(torch.int8),  # not uint8
    ):
        with pytest.raises(WireFormatError):
            quant.from_blob(bad)
    with pytest.raises(WireFormatError, match="at most 100"):
        quant.from_blob(good, max_elements=100)
