"""Tensors to and from wire bytes: dtype table, framing, and validation before allocation.

[Note: validate before allocating] A header is checked against the receiver's limits (dtype in
the table, sane shape, byte count == numel * itemsize, frame count) before any buffer is made, so
a hostile header can never make a server allocate more than ``CodecLimits`` allows.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy
import torch
from torch.utils.dlpack import from_dlpack

from pipesvc.errors import ResourceExhaustedError, WireFormatError
from pipesvc.v1 import common_pb2

# Wire values of DType and the torch dtype each stands for (fixed; see common.proto).
_TO_TORCH: dict[common_pb2.DType.ValueType, torch.dtype] = {
    common_pb2.FLOAT32: torch.float32,
    common_pb2.FLOAT64: torch.float64,
    common_pb2.FLOAT16: torch.float16,
    common_pb2.BFLOAT16: torch.bfloat16,
    common_pb2.INT64: torch.int64,
    common_pb2.INT32: torch.int32,
    common_pb2.INT16: torch.int16,
    common_pb2.INT8: torch.int8,
    common_pb2.UINT8: torch.uint8,
    common_pb2.BOOL: torch.bool,
}
_TO_WIRE: dict[torch.dtype, common_pb2.DType.ValueType] = {v: k for k, v in _TO_TORCH.items()}
_ITEMSIZE: dict[common_pb2.DType.ValueType, int] = {
    k: torch.empty((), dtype=v).element_size() for k, v in _TO_TORCH.items()
}
# numpy has no bfloat16: such tensors travel as their int16 bit pattern.
_BIT_VIEW: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}

DEFAULT_FRAME_BYTES = 1 << 20
"""Payload bytes per frame of named tensors (state transfers; 1 MiB)."""

STREAM_FRAME_BYTES = 16 << 20
"""Payload bytes per frame on an Exchange stream between stages (16 MiB).

[Note: stream frame size] Each frame is one gRPC message, and each message costs the sending and
the receiving process several thread hand-offs (gRPC's and pipesvc's) whatever its size, while a
tensor that fits one frame is received without a copy (see [Note: borrowed frames]); a tensor
of several frames is copied into one buffer. Measured with ``bench/paired_transport.py`` (see
bench/README.md), 16 MiB frames cost about a tenth less CPU per round trip than 1 MiB frames
at 4 and 8 MiB. Larger frames would add latency before a tensor's first byte leaves (the
serializer and gRPC each copy a frame once) and hold more memory in flight. A stage's frames
also stay within half its gRPC message limit (see ``pipesvc.core.limits.Limits.codec``)."""

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("pipesvc's wire format is little-endian; this host is big-endian")


@dataclass(frozen=True, kw_only=True, slots=True)
class CodecLimits:
    """What a receiver accepts in one tensor."""

    max_tensor_bytes: int = 4 << 30
    """Largest payload of one tensor."""
    max_elements: int = 1 << 31
    """Largest element count of one tensor."""
    max_dims: int = 8
    """Most dimensions."""
    max_frames: int = 1 << 16
    """Most frames one tensor may be split into."""
    max_frame_bytes: int = STREAM_FRAME_BYTES
    """Payload bytes per frame this side sends on a stream (what it receives is bounded by
    gRPC's message limit)."""


DEFAULT_LIMITS = CodecLimits()


def wire_dtype(dtype: torch.dtype) -> common_pb2.DType.ValueType:
    """The DType enum value for a torch dtype.

    Raises:
        WireFormatError: the dtype has no wire encoding (e.g. complex).
    """
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in _TO_WIRE)
        raise WireFormatError(f"dtype {dtype} cannot be sent; expected one of {known}") from None


def torch_dtype(value: int) -> torch.dtype:
    """The torch dtype a DType enum value stands for.

    Raises:
        WireFormatError: the value names no dtype.
    """
    try:
        return _TO_TORCH[value]  # type: ignore[index]
    except KeyError:
        raise WireFormatError(f"dtype {value} is not a DType this side knows") from None


def _host_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in host memory: a view, no copy, of a contiguous CPU tensor."""
    flat = tensor.detach()
    if flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.to("cpu").contiguous()
    bits = _BIT_VIEW.get(flat.dtype)
    if bits is not None:
        flat = flat.view(bits)
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def _host_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(_host_view(tensor))


def make_header(tensor: torch.Tensor, num_frames: int = 1) -> common_pb2.TensorHeader:
    """The header describing ``tensor`` split into ``num_frames`` frames."""
    return common_pb2.TensorHeader(
        dtype=wire_dtype(tensor.dtype),
        shape=list(tensor.shape),
        num_bytes=tensor.numel() * tensor.element_size(),
        num_frames=num_frames,
    )


def encode(tensor: torch.Tensor) -> common_pb2.Tensor:
    """One whole tensor as a single message (control path)."""
    return common_pb2.Tensor(header=make_header(tensor), data=_host_bytes(tensor))


def encode_frames(
    tensor: torch.Tensor, frame_bytes: int = DEFAULT_FRAME_BYTES
) -> tuple[common_pb2.TensorHeader, Iterator[bytes]]:
    """A header and the payload cut into frames of at most ``frame_bytes``."""
    payload = _host_bytes(tensor)
    num_frames = max(1, math.ceil(len(payload) / frame_bytes))
    header = make_header(tensor, num_frames)
    if num_frames == 1:
        return header, iter((payload,))
    view = memoryview(payload)
    return header, (bytes(view[i : i + frame_bytes]) for i in range(0, len(payload), frame_bytes))


def frame_views(
    tensor: torch.Tensor, frame_bytes: int = DEFAULT_FRAME_BYTES
) -> tuple[common_pb2.TensorHeader, list[memoryview]]:
    """A header and views of the tensor's host memory, one per frame: no copy of a CPU tensor
    (a view keeps its memory alive; the tensor must not change until the views are sent)."""
    payload = _host_view(tensor)
    num_frames = max(1, math.ceil(len(payload) / frame_bytes))
    header = make_header(tensor, num_frames)
    return header, [
        payload[i : i + frame_bytes] for i in range(0, max(len(payload), 1), frame_bytes)
    ]


def payload_view(tensor: torch.Tensor) -> tuple[common_pb2.TensorHeader, memoryview]:
    """A header and a view of the tensor's host memory, to send as one payload beside its
    message (see [Note: payload wire] in ``pipesvc.wire.payload_wire``): no copy of a
    contiguous CPU tensor (the view keeps its memory alive; the tensor must not change until
    it is sent)."""
    return make_header(tensor), _host_view(tensor)


def check_header(header: common_pb2.TensorHeader, limits: CodecLimits = DEFAULT_LIMITS) -> None:
    """Validates a header against the wire rules and ``limits``.

    Raises:
        WireFormatError: unknown dtype, bad shape, byte count or frame count.
        ResourceExhaustedError: the tensor exceeds a limit.
    """
    if header.dtype not in _TO_TORCH:
        raise WireFormatError(f"tensor dtype {header.dtype} is not a known DType value")
    shape = list(header.shape)
    if len(shape) > limits.max_dims:
        raise ResourceExhaustedError(
            f"tensor has {len(shape)} dimensions; at most {limits.max_dims} are accepted"
        )
    if any(d < 0 for d in shape):
        raise WireFormatError(f"tensor shape {shape} has a negative dimension")
    numel = math.prod(shape)
    if numel > limits.max_elements:
        raise ResourceExhaustedError(
            f"tensor of shape {shape} has {numel} elements; at most {limits.max_elements}"
        )
    if any(d > limits.max_elements for d in shape):
        # Checked per dimension too: a zero elsewhere would hide it from the product.
        raise ResourceExhaustedError(
            f"tensor shape {shape} has a dimension above {limits.max_elements}"
        )
    itemsize = _ITEMSIZE[header.dtype]
    if header.num_bytes != numel * itemsize:
        raise WireFormatError(
            f"tensor num_bytes {header.num_bytes} does not match shape {shape} x itemsize "
            f"{itemsize} = {numel * itemsize}"
        )
    if header.num_bytes > limits.max_tensor_bytes:
        raise ResourceExhaustedError(
            f"tensor of {header.num_bytes} bytes exceeds the limit of {limits.max_tensor_bytes}"
        )
    if not 1 <= header.num_frames <= limits.max_frames:
        raise WireFormatError(
            f"tensor num_frames {header.num_frames} must be in [1, {limits.max_frames}]"
        )


def view_as_header(raw: torch.Tensor, header: common_pb2.TensorHeader) -> torch.Tensor:
    """The bytes ``raw`` (uint8, exactly ``header.num_bytes``, checked header) viewed as the
    header's dtype and shape, no copy."""
    return raw.view(_TO_TORCH[header.dtype]).reshape(tuple(header.shape))


def _from_buffer(buffer: bytearray, header: common_pb2.TensorHeader) -> torch.Tensor:
    dtype = _TO_TORCH[header.dtype]
    shape = tuple(header.shape)
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    storage_dtype = _BIT_VIEW.get(dtype, dtype)
    flat = torch.frombuffer(buffer, dtype=storage_dtype)
    return flat.view(dtype).reshape(shape) if storage_dtype != dtype else flat.reshape(shape)


def _read_only(view: memoryview, header: common_pb2.TensorHeader) -> torch.Tensor:
    """The bytes ``view`` (exactly ``header.num_bytes``, checked header) as the header's dtype
    and shape, no copy, whether or not ``view`` is writable.

    ``torch.frombuffer`` warns on a read-only buffer (the received bytes of a request are a
    ``bytes`` object); a read-only numpy array imported through DLPack is the same memory
    without the warning, and the capsule keeps ``view`` (so the received bytes) alive for as
    long as the tensor lives."""
    dtype = _TO_TORCH[header.dtype]
    shape = tuple(header.shape)
    if not len(view):
        return torch.empty(shape, dtype=dtype)
    raw = from_dlpack(numpy.frombuffer(view, dtype=numpy.uint8))
    return raw.view(dtype).reshape(shape)


def _borrowed(view: memoryview, header: common_pb2.TensorHeader) -> torch.Tensor:
    """``_read_only``, except that bytes not starting at a multiple of the dtype's item size
    are copied: kernels may assume natural alignment (vectorized loops that peel to an
    aligned address), and a misaligned view could fault."""
    tensor = _read_only(view, header)
    if tensor.data_ptr() % _ITEMSIZE[header.dtype]:
        tensor = tensor.clone()
    return tensor


def decode(
    message: common_pb2.Tensor,
    limits: CodecLimits = DEFAULT_LIMITS,
    payloads: Sequence[memoryview] = (),
    *,
    copy: bool = True,
) -> torch.Tensor:
    """A tensor from a single-message encoding, validated first: its bytes in ``data``, or
    (``payload`` set) in ``payloads[payload]``, the payloads of the request it came in (see
    [Note: payload wire] in ``pipesvc.wire.payload_wire``).

    ``copy`` False: the tensor of a payload is a view of the received bytes, with no copy,
    for a receiver that never writes to it (nothing may: the bytes are read-only memory);
    True: a writable tensor of its own. A tensor in ``data`` is always a copy.

    Raises:
        WireFormatError: the header or payload is malformed, or names a payload that is not
            there.
        ResourceExhaustedError: the tensor exceeds a limit.
    """
    if not message.HasField("header"):
        raise WireFormatError("tensor message has no header")
    header = message.header
    check_header(header, limits)
    if header.num_frames != 1:
        raise WireFormatError(f"a single-message tensor has num_frames 1, got {header.num_frames}")
    if message.HasField("payload"):
        index = message.payload
        if message.data:
            raise WireFormatError(
                f"tensor names payload {index} and carries {len(message.data)} bytes of data; "
                "expected one or the other"
            )
        if index >= len(payloads):
            raise WireFormatError(
                f"tensor names payload {index}; the request carries {len(payloads)} payloads"
            )
        view = payloads[index]
        if len(view) != header.num_bytes:
            raise WireFormatError(
                f"tensor payload {index} is {len(view)} bytes; header says {header.num_bytes}"
            )
        return _read_only(view, header) if not copy else _from_buffer(bytearray(view), header)
    if len(message.data) != header.num_bytes:
        raise WireFormatError(
            f"tensor payload is {len(message.data)} bytes; header says {header.num_bytes}"
        )
    return _from_buffer(bytearray(message.data), header)


_NO_BYTES = torch.empty(0, dtype=torch.uint8)


class FrameAssembler:
    """Reassembles one framed tensor, checking order and sizes frame by frame.

    [Note: borrowed frames] With ``borrow`` a tensor that came in one frame is a view of that
    frame's received bytes, with no copy (a 1 MiB copy, with the zeroing of a fresh buffer,
    cost about as much CPU as gRPC's own handling of the message). The receiver must own those
    bytes alone, as the Exchange stream's parser does (``pipesvc.stage.dataplane.frame_wire.parse``:
    the message's ``bytes`` object is referenced by nothing else once gRPC hands it over), since
    the tensor may be written to by the model (an in-place op) and keeps the whole message
    alive while it lives. A tensor of several frames is copied into one buffer, which is not
    zeroed first (every byte is written by a frame before the tensor is returned).
    """

    def __init__(
        self,
        header: common_pb2.TensorHeader,
        limits: CodecLimits = DEFAULT_LIMITS,
        *,
        borrow: bool = False,
    ):
        check_header(header, limits)
        self._header = header
        self._borrow = borrow and header.num_frames == 1
        self._raw = _NO_BYTES
        self._buffer = memoryview(b"")
        if not self._borrow:
            self._raw = torch.empty(header.num_bytes, dtype=torch.uint8)
            self._buffer = memoryview(self._raw.numpy())  # type: ignore[arg-type]
        self._filled = 0
        self._next_frame = 0

    @property
    def complete(self) -> bool:
        """Whether every frame has arrived."""
        return bool(self._next_frame == self._header.num_frames)

    def add(self, frame_index: int, data: bytes | memoryview) -> torch.Tensor | None:
        """Adds the next frame; returns the tensor once the last frame is in.

        Raises:
            WireFormatError: a frame is out of order, too long, or the sizes do not add up.
        """
        if self.complete:
            raise WireFormatError(f"frame {frame_index} arrived after the tensor was complete")
        if frame_index != self._next_frame:
            raise WireFormatError(f"frame {frame_index} arrived; expected {self._next_frame}")
        if self._borrow:
            if len(data) != self._header.num_bytes:
                raise WireFormatError(
                    f"frame carries {len(data)} bytes; header says {self._header.num_bytes}"
                )
            self._next_frame = 1
            return _borrowed(memoryview(data), self._header)
        end = self._filled + len(data)
        if end > len(self._buffer):
            raise WireFormatError(
                f"frames carry more than the header's {self._header.num_bytes} bytes"
            )
        self._buffer[self._filled : end] = data
        self._filled = end
        self._next_frame += 1
        if not self.complete:
            return None
        if self._filled != len(self._buffer):
            raise WireFormatError(
                f"frames carried {self._filled} bytes; header says {self._header.num_bytes}"
            )
        return view_as_header(self._raw, self._header)


def named_frames(
    name: str, tensor: torch.Tensor, frame_bytes: int = DEFAULT_FRAME_BYTES
) -> Iterator[common_pb2.TensorFrame]:
    """The frames of one named tensor (a state_dict entry), the header on frame 0."""
    header, payloads = encode_frames(tensor, frame_bytes)
    for index, data in enumerate(payloads):
        frame = common_pb2.TensorFrame(name=name, frame_index=index, data=data)
        if index == 0:
            frame.header.CopyFrom(header)
        yield frame


def read_named_frames(
    frames: Iterable[common_pb2.TensorFrame], limits: CodecLimits = DEFAULT_LIMITS
) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole named tensors from a stream of frames, each tensor's frames back to back.

    Raises:
        WireFormatError: a tensor begins before the last one ended, a frame comes without
            its frame 0, or the stream ends mid-tensor.
        ResourceExhaustedError: a header exceeds ``limits``.
    """
    pending: tuple[str, FrameAssembler] | None = None
    for frame in frames:
        if frame.frame_index == 0:
            if pending is not None:
                raise WireFormatError(f"tensor {frame.name!r} began before {pending[0]!r} ended")
            pending = (frame.name, FrameAssembler(frame.header, limits))
        if pending is None or pending[0] != frame.name:
            raise WireFormatError(f"frame {frame.frame_index} of {frame.name!r} without frame 0")
        tensor = pending[1].add(frame.frame_index, frame.data)
        if tensor is not None:
            yield pending[0], tensor
            pending = None
    if pending is not None:
        raise WireFormatError(f"tensor {pending[0]!r} ended before its last frame")
