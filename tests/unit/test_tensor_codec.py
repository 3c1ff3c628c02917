"""Unit tests for the tensor codec: round trips, framing, and validation before allocation."""

from __future__ import annotations

import time

import numpy
import pytest
import torch

from pipesvc.core.tensor_codec import (
    CodecLimits,
    FrameAssembler,
    check_header,
    decode,
    encode,
    encode_frames,
    payload_view,
    wire_dtype,
)
from pipesvc.errors import PipesvcError, ResourceExhaustedError, WireFormatError
from pipesvc.v1 import common_pb2

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct, dtype-representable values (bool alternates), including negatives if signed."""
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, shape, generator=gen, dtype=dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def assemble(tensor: torch.Tensor, frame_bytes: int) -> tuple[int, torch.Tensor]:
    header, frames = encode_frames(tensor, frame_bytes)
    assembler = FrameAssembler(header)
    result = None
    for index, frame in enumerate(frames):
        assert result is None, "the assembler returned a tensor before the last frame"
        assert len(frame) <= frame_bytes
        result = assembler.add(index, frame)
    assert result is not None and assembler.complete
    return header.num_frames, result


def header(
    dtype: int = common_pb2.FLOAT32,
    shape: tuple[int, ...] = (2, 3),
    num_bytes: int | None = None,
    num_frames: int = 1,
) -> common_pb2.TensorHeader:
    if num_bytes is None:
        num_bytes = 4 * int(torch.Size(shape).numel())
    return common_pb2.TensorHeader(
        dtype=dtype, shape=list(shape), num_bytes=num_bytes, num_frames=num_frames
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (3, 7)], ids=str)
def test_encode_decode_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = sample(dtype, shape)
    message = encode(tensor)
    assert message.header.num_bytes == tensor.numel() * tensor.element_size()
    assert len(message.data) == message.header.num_bytes
    assert_same(decode(message), tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_framed_round_trip_with_small_frames(dtype: torch.dtype) -> None:
    tensor = sample(dtype, (5, 7))
    payload = tensor.numel() * tensor.element_size()
    num_frames, result = assemble(tensor, frame_bytes=3)
    assert num_frames == -(-payload // 3)
    assert_same(result, tensor)


@pytest.mark.parametrize("shape", [(0,), (0, 4)], ids=str)
def test_framed_empty_tensor_uses_one_empty_frame(shape: tuple[int, ...]) -> None:
    tensor = sample(torch.float32, shape)
    num_frames, result = assemble(tensor, frame_bytes=2)
    assert num_frames == 1
    assert_same(result, tensor)


@pytest.mark.parametrize(("frame_bytes", "expected_frames"), [(8, 1), (4, 1), (3, 2), (1, 4)])
def test_framed_scalar(frame_bytes: int, expected_frames: int) -> None:
    tensor = torch.tensor(-2.5)
    num_frames, result = assemble(tensor, frame_bytes)
    assert num_frames == expected_frames
    assert_same(result, tensor)


def test_non_contiguous_inputs_round_trip() -> None:
    base = sample(torch.float32, (4, 6))
    views = [base.t(), base[:, ::2], base[1:3, 1:5], base.expand(2, 4, 6)[1]]
    for view in views:
        assert_same(decode(encode(view)), view.contiguous())
        assert_same(assemble(view, frame_bytes=5)[1], view.contiguous())
    bf16 = sample(torch.bfloat16, (4, 6)).t()
    assert not bf16.is_contiguous()
    assert_same(decode(encode(bf16)), bf16.contiguous())


def test_bytes_are_little_endian_c_order() -> None:
    message = encode(torch.tensor([[1, 2], [3, 4]], dtype=torch.int16).t())
    assert message.data == bytes([1, 0, 3, 0, 2, 0, 4, 0])


def test_wire_dtype_rejects_complex() -> None:
    with pytest.raises(WireFormatError, match="complex64"):
        wire_dtype(torch.complex64)
    with pytest.raises(WireFormatError, match="complex128"):
        encode(torch.zeros(2, dtype=torch.complex128))


def test_wire_dtypes_are_distinct_and_not_unspecified() -> None:
    values = [wire_dtype(d) for d in DTYPES]
    assert len(set(values)) == len(DTYPES)
    assert common_pb2.DTYPE_UNSPECIFIED not in values


@pytest.mark.parametrize("dtype", [common_pb2.DTYPE_UNSPECIFIED, 99])
def test_check_header_rejects_unknown_dtype(dtype: int) -> None:
    with pytest.raises(WireFormatError, match=f"dtype {dtype} "):
        check_header(header(dtype=dtype))


def test_check_header_rejects_negative_dims() -> None:
    with pytest.raises(WireFormatError, match=r"\[2, -3\]"):
        check_header(header(shape=(2, -3), num_bytes=0))


@pytest.mark.parametrize("num_bytes", [0, 23, 25, 48])
def test_check_header_rejects_byte_count_mismatch(num_bytes: int) -> None:
    with pytest.raises(WireFormatError, match=f"num_bytes {num_bytes} "):
        check_header(header(shape=(2, 3), num_bytes=num_bytes))


@pytest.mark.parametrize("num_frames", [0, 17])
def test_check_header_rejects_frame_count(num_frames: int) -> None:
    limits = CodecLimits(max_frames=16)
    with pytest.raises(WireFormatError, match=f"num_frames {num_frames} "):
        check_header(header(num_frames=num_frames), limits)
    check_header(header(num_frames=16), limits)


def test_check_header_limits() -> None:
    limits = CodecLimits(max_dims=3, max_elements=100, max_tensor_bytes=200)
    check_header(header(shape=(5, 10)), limits)  # exactly at the byte limit
    with pytest.raises(ResourceExhaustedError, match="4 dimensions"):
        check_header(header(shape=(1, 1, 1, 1)), limits)
    with pytest.raises(ResourceExhaustedError, match="101 elements"):
        check_header(header(shape=(101,)), limits)
    with pytest.raises(ResourceExhaustedError, match="400 bytes"):
        check_header(header(dtype=common_pb2.FLOAT64, shape=(50,), num_bytes=400), limits)


@pytest.mark.parametrize("shape", [(2**40,), (2**31, 2**31), (2**62, 2**62, 2**62)], ids=str)
def test_huge_header_is_rejected_before_allocation(shape: tuple[int, ...]) -> None:
    numel = 1
    for dim in shape:
        numel *= dim
    hostile = header(shape=shape, num_bytes=min(4 * numel, 2**64 - 1))
    started = time.monotonic()
    with pytest.raises(ResourceExhaustedError, match=str(numel)):
        check_header(hostile)
    with pytest.raises(ResourceExhaustedError):
        FrameAssembler(hostile)
    with pytest.raises(ResourceExhaustedError):
        decode(common_pb2.Tensor(header=hostile))
    assert time.monotonic() - started < 1.0


def test_empty_tensor_with_huge_dims_is_a_wire_error() -> None:
    # numel is 0, but torch cannot even describe this shape: it must be refused as bad input,
    # not escape as a RuntimeError (which the edge would report as INTERNAL).
    hostile = header(shape=(0, 2**40, 2**40), num_bytes=0)
    with pytest.raises(PipesvcError):
        decode(common_pb2.Tensor(header=hostile))
    with pytest.raises(PipesvcError):
        FrameAssembler(hostile).add(0, b"")


def framed(num_frames: int = 3) -> FrameAssembler:
    return FrameAssembler(header(shape=(3,), num_bytes=12, num_frames=num_frames))


def test_assembler_rejects_out_of_order_frames() -> None:
    assembler = framed()
    with pytest.raises(WireFormatError, match="frame 1 arrived; expected 0"):
        assembler.add(1, b"\0" * 4)
    assembler.add(0, b"\0" * 4)
    with pytest.raises(WireFormatError, match="frame 0 arrived; expected 1"):
        assembler.add(0, b"\0" * 4)


def test_assembler_rejects_extra_bytes() -> None:
    assembler = framed()
    assembler.add(0, b"\0" * 8)
    with pytest.raises(WireFormatError, match="12 bytes"):
        assembler.add(1, b"\0" * 5)


def test_assembler_rejects_short_payload() -> None:
    assembler = framed()
    assembler.add(0, b"\0" * 4)
    assembler.add(1, b"\0" * 4)
    with pytest.raises(WireFormatError, match="carried 11 bytes; header says 12"):
        assembler.add(2, b"\0" * 3)


def test_assembler_rejects_frames_after_completion() -> None:
    assembler = framed(num_frames=1)
    result = assembler.add(0, torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes())
    assert result is not None
    assert result.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(WireFormatError, match="frame 1 arrived after"):
        assembler.add(1, b"")


def _aligned_bytes(payload: bytes, offset: int) -> memoryview:
    """``payload`` at ``offset`` bytes past a 16-byte boundary inside a fresh ``bytes``."""
    base = numpy.frombuffer(bytes(16), dtype=numpy.uint8).ctypes.data % 16  # bytes' own
    pad = (offset - base) % 16
    return memoryview(bytes(pad) + payload)[pad:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_borrowed_single_frame_is_the_received_bytes(dtype: torch.dtype) -> None:
    tensor = sample(dtype, (4, 5))
    header_, view = payload_view(tensor)
    data = _aligned_bytes(view.tobytes(), 0)
    result = FrameAssembler(header_, borrow=True).add(0, data)
    assert result is not None
    assert_same(result, tensor)
    # no copy: the tensor's memory is the received message's
    assert result.data_ptr() == numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data


def test_borrowed_frame_that_is_not_aligned_is_copied() -> None:
    tensor = torch.arange(6, dtype=torch.float64)
    header_, view = payload_view(tensor)
    data = _aligned_bytes(view.tobytes(), 4)  # 4 past 16: misaligned for float64
    result = FrameAssembler(header_, borrow=True).add(0, data)
    assert result is not None
    assert_same(result, tensor)
    assert result.data_ptr() % 8 == 0
    assert result.data_ptr() != numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data


def test_borrow_copies_a_tensor_of_several_frames_into_its_own_buffer() -> None:
    tensor = torch.arange(12, dtype=torch.float32)
    header_, frames = encode_frames(tensor, 16)
    assembler = FrameAssembler(header_, borrow=True)
    received = [bytes(frame) for frame in frames]
    results = [assembler.add(i, frame) for i, frame in enumerate(received)]
    result = results[-1]
    assert result is not None and results[:-1] == [None, None]
    assert_same(result, tensor)
    result.add_(1)  # its own memory: the received frames are unchanged
    assert received[0] == payload_view(torch.arange(4, dtype=torch.float32))[1].tobytes()


@pytest.mark.parametrize("length", [11, 13])
def test_borrowed_frame_of_the_wrong_length_is_refused(length: int) -> None:
    with pytest.raises(WireFormatError, match=f"frame carries {length} bytes; header says 12"):
        FrameAssembler(header(shape=(3,), num_bytes=12), borrow=True).add(0, b"\0" * length)


def test_borrow_checks_the_header_before_anything_else() -> None:
    with pytest.raises(ResourceExhaustedError):
        FrameAssembler(header(shape=(2**20,)), CodecLimits(max_tensor_bytes=1 << 20), borrow=True)


def test_assembler_checks_its_header() -> None:
    with pytest.raises(WireFormatError, match="num_bytes 7 "):
        FrameAssembler(header(shape=(3,), num_bytes=7))


def test_decode_rejects_missing_header() -> None:
    with pytest.raises(WireFormatError, match="no header"):
        decode(common_pb2.Tensor(data=b"\0" * 4))


@pytest.mark.parametrize("length", [0, 23, 25])
def test_decode_rejects_wrong_payload_length(length: int) -> None:
    message = common_pb2.Tensor(header=header(shape=(2, 3)), data=b"\0" * length)
    with pytest.raises(WireFormatError, match=f"payload is {length} bytes; header says 24"):
        decode(message)


def test_decode_rejects_multi_frame_header() -> None:
    message = common_pb2.Tensor(header=header(shape=(2, 3), num_frames=2), data=b"\0" * 24)
    with pytest.raises(WireFormatError, match="got 2"):
        decode(message)


def test_decoded_tensor_is_independent_of_the_message() -> None:
    tensor = torch.arange(4, dtype=torch.int32)
    message = encode(tensor)
    decoded = decode(message)
    decoded += 10
    assert_same(decode(message), tensor)


def test_named_frames_round_trip_and_order_rules() -> None:
    from pipesvc.core.tensor_codec import named_frames, read_named_frames

    tensors = {"0.weight": torch.randn(5, 7), "1.bias": torch.arange(3)}
    frames = [f for name, t in tensors.items() for f in named_frames(name, t, frame_bytes=16)]
    assert len(frames) > len(tensors)  # really split into several frames
    restored = dict(read_named_frames(frames))
    assert restored.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(restored[name], tensor)

    first = list(named_frames("a", torch.randn(8), frame_bytes=8))
    second = list(named_frames("b", torch.randn(8), frame_bytes=8))
    with pytest.raises(WireFormatError, match="began before"):
        list(read_named_frames([first[0], second[0]]))
    with pytest.raises(WireFormatError, match="without frame 0"):
        list(read_named_frames(first[1:]))
    with pytest.raises(WireFormatError, match="ended before its last frame"):
        list(read_named_frames(first[:-1]))


@pytest.mark.parametrize(
    "tensor",
    [torch.randn(1000), torch.randn(7, 3).to(torch.bfloat16), torch.arange(12)[::3], torch.ones(0)],
    ids=["f32", "bf16", "strided", "empty"],
)
def test_frame_views_carry_the_bytes_encode_frames_copies(tensor: torch.Tensor) -> None:
    from pipesvc.core.tensor_codec import encode_frames, frame_views

    header, views = frame_views(tensor, frame_bytes=256)
    expected_header, payloads = encode_frames(tensor, frame_bytes=256)
    assert header == expected_header
    assert [bytes(v) for v in views] == list(payloads)
