"""The protobuf wire format at the level of top-level fields: varints and a field walker.

What a codec needs to build or take apart a message around fields that protobuf itself should
not copy (see [Note: payload wire] in ``payload_wire``); no gRPC here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pipesvc.errors import WireFormatError

LENGTH_DELIMITED = 2
"""Wire type of bytes, strings and nested messages."""
_FIXED_SIZE = {1: 8, 5: 4}
"""Wire types of fixed width (fixed64 and double, fixed32 and float) and their sizes."""
_MAX_VARINT_BYTES = 10


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def tag(field: int, wire_type: int) -> bytes:
    """The key that starts field ``field`` of ``wire_type``."""
    return varint((field << 3) | wire_type)


def read_varint(buf: memoryview, pos: int, what: str) -> tuple[int, int]:
    """The varint at ``pos`` of ``buf`` and the position after it.

    Raises:
        WireFormatError: it runs past the end or is longer than 10 bytes (names ``what``).
    """
    result = shift = 0
    end = min(len(buf), pos + _MAX_VARINT_BYTES)
    while pos < end:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise WireFormatError(f"{what}: truncated or overlong varint at byte {pos}")


@dataclass(frozen=True, slots=True)
class Field:
    """One top-level field of a message as it lies in the buffer."""

    number: int
    wire_type: int
    start: int
    """Where its key begins."""
    value_start: int
    """Where its value begins (after the length of a length-delimited field)."""
    end: int
    """One past its last byte."""


def fields(buf: memoryview, what: str) -> Iterator[Field]:
    """The top-level fields of the message in ``buf``, in order, none read past the end.

    Raises:
        WireFormatError: a truncated field, a field number 0, or a group (wire types 3 and 4:
            deprecated, and never in pipesvc's messages); names ``what``.
    """
    pos, size = 0, len(buf)
    while pos < size:
        start = pos
        key, pos = read_varint(buf, pos, what)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireFormatError(f"{what}: field number 0 at byte {start}")
        if wire_type == 0:
            value_start = pos
            _, pos = read_varint(buf, pos, what)
        elif wire_type in _FIXED_SIZE:
            value_start = pos
            pos += _FIXED_SIZE[wire_type]
        elif wire_type == LENGTH_DELIMITED:
            length, value_start = read_varint(buf, pos, what)
            pos = value_start + length
        else:
            raise WireFormatError(f"{what}: field {number} has unsupported wire type {wire_type}")
        if pos > size:
            raise WireFormatError(
                f"{what}: field {number} runs {pos - size} bytes past the end of the message"
            )
        yield Field(number, wire_type, start, value_start, pos)
