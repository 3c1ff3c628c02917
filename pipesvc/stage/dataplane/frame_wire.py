"""DataFrame messages to and from wire bytes without copying payloads through protobuf.

[Note: frame wire] A frame's payload (field 4, ``data``) is most of its bytes. Building a
``DataFrame`` with it copies the payload into the message, and serializing copies it again;
parsing copies it out once more. Here a sent frame is the message without ``data`` plus a view
of the tensor's memory: serializing is one ``join`` of field 4's tag and length, the view, and
the other fields (protobuf allows fields in any order, and a parser takes the last
occurrence). The payload comes first, 16 bytes into the message: before it, ``frame_index``
(field 3) as a 9-byte varint and field 4's tag and length as a 5-byte varint (protobuf reads
varints with redundant continuation bytes: up to 10 bytes for a value, 5 for a length; the
head repeats ``frame_index``, and the last occurrence is the same value). Received into a
``bytes`` object, whose data is 16-byte aligned, the payload is then aligned for any dtype,
which lets the receiver use it as the tensor itself (see [Note: borrowed frames] in
``pipesvc.core.tensor_codec``). A received frame is parsed by walking its top-level fields:
field 4 becomes a zero-copy view of the received bytes, the other fields are parsed by
protobuf as usual. Both ends accept any valid encoding, so either side may still use plain
``SerializeToString`` (a receiver copies a payload that is not aligned).

No gRPC here: the functions are the Exchange method's serializer and deserializer.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from pipesvc.v1 import stage_pb2

_DATA_FIELD = 4
_DATA_TAG = bytes([(_DATA_FIELD << 3) | 2])
_INDEX_TAG = bytes([3 << 3])  # frame_index, a varint
_INDEX_BYTES = 9
_LENGTH_BYTES = 5
"""Widths of the leading frame_index and the payload's length: 1 + 9 + 1 + 5 = 16 bytes."""


@dataclass(frozen=True, slots=True)
class OutFrame:
    """A frame to send: ``frame`` without data, and the payload to append."""

    frame: stage_pb2.DataFrame
    data: memoryview


@dataclass(frozen=True, slots=True)
class InFrame:
    """A received frame: ``frame`` without data, and a view of the payload in the message."""

    frame: stage_pb2.DataFrame
    data: memoryview


def _varint(value: int, width: int = 1) -> bytes:
    """``value`` as a varint of at least ``width`` bytes (padded with continuation bytes)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value or len(out) + 1 < width:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DecodeError("truncated or overlong varint in a DataFrame")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def serialize(item: OutFrame | stage_pb2.DataFrame) -> bytes:
    """Wire bytes of a frame (the Exchange serializer)."""
    if isinstance(item, OutFrame):
        head = item.frame.SerializeToString()
        index = _varint(item.frame.frame_index, _INDEX_BYTES)
        length = _varint(len(item.data), _LENGTH_BYTES)
        return b"".join((_INDEX_TAG, index, _DATA_TAG, length, item.data, head))
    data: bytes = item.SerializeToString()
    return data


def parse(buf: bytes) -> InFrame:
    """A frame from wire bytes, its payload a view into ``buf`` (the Exchange deserializer).

    Raises:
        DecodeError: malformed bytes.
    """
    view = memoryview(buf)
    rest: list[memoryview] = []
    data = view[0:0]
    pos, end = 0, len(buf)
    while pos < end:
        start = pos
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise DecodeError(f"field {field} runs past the end of the DataFrame")
            if field == _DATA_FIELD:
                data = view[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise DecodeError(f"unsupported wire type {wire_type} in a DataFrame")
        if pos > end:
            raise DecodeError(f"field {field} runs past the end of the DataFrame")
        rest.append(view[start:pos])
    return InFrame(stage_pb2.DataFrame.FromString(b"".join(rest)), data)
