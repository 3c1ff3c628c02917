"""Exchange's frame (de)serializer: the same bytes protobuf reads and writes, no payload copies."""

from __future__ import annotations

import numpy
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesvc.stage.dataplane.frame_wire import OutFrame, parse, serialize
from pipesvc.v1 import common_pb2, stage_pb2


def _frame(index: int, job: str, with_header: bool) -> stage_pb2.DataFrame:
    frame = stage_pb2.DataFrame(
        id=stage_pb2.MicrobatchId(job_id=job, plan_epoch=3, run_id=7, microbatch_index=index),
        frame_index=index,
    )
    if with_header:
        frame.header.CopyFrom(
            common_pb2.TensorHeader(dtype=common_pb2.FLOAT32, shape=[2, 3], num_bytes=24)
        )
    return frame


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    index=st.integers(0, 2**32 - 1),
    job=st.text(max_size=40),
    with_header=st.booleans(),
    data=st.binary(max_size=3000),
)
def test_round_trip_agrees_with_protobuf(
    index: int, job: str, with_header: bool, data: bytes
) -> None:
    frame = _frame(index, job, with_header)
    wire = serialize(OutFrame(frame, memoryview(data)))
    expected = stage_pb2.DataFrame()
    expected.CopyFrom(frame)
    expected.data = data
    assert stage_pb2.DataFrame.FromString(wire) == expected  # protobuf reads our bytes
    parsed = parse(wire)
    assert parsed.frame == frame and bytes(parsed.data) == data
    theirs = parse(expected.SerializeToString())  # and we read protobuf's
    assert theirs.frame == frame and bytes(theirs.data) == data


def test_payload_is_a_view_not_a_copy() -> None:
    wire = serialize(OutFrame(_frame(0, "j", True), memoryview(b"x" * 1000)))
    parsed = parse(wire)
    assert parsed.data.obj is wire


@pytest.mark.parametrize("index", [0, 1, 2**32 - 1])
@pytest.mark.parametrize("length", [0, 1, 1 << 20])
def test_payload_starts_16_bytes_into_the_message(index: int, length: int) -> None:
    # So that, received into a bytes object (16-byte aligned), the payload can be the tensor
    # itself (see [Note: borrowed frames]).
    data = bytes(range(256)) * (length // 256) + bytes(length % 256)
    wire = serialize(OutFrame(_frame(index, "j", True), memoryview(data)))
    assert wire[16 : 16 + length] == data
    parsed = parse(wire)
    assert parsed.frame.frame_index == index
    assert numpy.frombuffer(parsed.data, dtype=numpy.uint8).ctypes.data % 16 == 0 or not length


def test_control_frames_pass_through() -> None:
    frame = stage_pb2.DataFrame(shm_answer=stage_pb2.ShmAnswer(name="n", accepted=True))
    assert serialize(frame) == frame.SerializeToString()
    assert parse(serialize(frame)).frame == frame


def test_last_data_field_wins_like_protobuf() -> None:
    wire = serialize(OutFrame(_frame(1, "j", False), memoryview(b"first")))
    wire += b"\x22\x06second"
    assert bytes(parse(wire).data) == b"second" == stage_pb2.DataFrame.FromString(wire).data


@pytest.mark.parametrize(
    "wire",
    [
        b"\x22\x10short",  # length past the end
        b"\x08\xff\xff",  # truncated varint
        b"\x08" + b"\xff" * 11,  # overlong varint
        b"\x0b",  # group wire type
        b"\x09\x01\x02",  # fixed64 past the end
    ],
    ids=["length", "truncated", "overlong", "group", "fixed64"],
)
def test_malformed_bytes_raise_decode_error(wire: bytes) -> None:
    with pytest.raises(DecodeError):
        parse(wire)
