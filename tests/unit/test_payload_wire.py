"""Requests whose tensors' bytes travel beside the message ([Note: payload wire]): the same
bytes protobuf reads and writes, payloads as views on both ends, every malformed request a
typed error before anything is allocated."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesvc.coordinator.step_request import batch_digest, forward_batch, train_batch
from pipesvc.core.tensor_codec import CodecLimits, decode, encode
from pipesvc.errors import InvalidArgumentError, ResourceExhaustedError, WireFormatError
from pipesvc.v1 import common_pb2, coordinator_pb2, stage_pb2
from pipesvc.wire.payload_wire import RUN_STEP, TRAIN_STEP, Incoming, Outgoing, Payloads
from pipesvc.wire.proto_fields import fields, read_varint, varint

LIMITS = CodecLimits()
MIB = 1 << 20


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "inputs": torch.randn(768, 1024, generator=generator),  # 3 MiB of float32
        "targets": torch.randint(-(2**40), 2**40, (512, 1024), generator=generator),  # 4 MiB
        "bf16": torch.randn(1024, 1024, generator=generator).to(torch.bfloat16),  # 2 MiB
        "empty": torch.zeros(0, 7),
        "mask": torch.ones(3, 5, dtype=torch.bool),
    }


def _train_request(tensors: dict[str, torch.Tensor]) -> Outgoing[coordinator_pb2.TrainStepRequest]:
    payloads = Payloads()
    message = coordinator_pb2.TrainStepRequest(
        job_id="j",
        inputs=payloads.tensor(tensors["inputs"]),
        targets=payloads.tensor(tensors["targets"]),
        side_inputs={n: payloads.tensor(tensors[n]) for n in ("bf16", "empty", "mask")},
        request_id="r",
    )
    return TRAIN_STEP.outgoing(message, payloads)


def _decoded(incoming: Incoming[coordinator_pb2.TrainStepRequest]) -> dict[str, torch.Tensor]:
    message, payloads = incoming.message, incoming.payloads
    out = {
        "inputs": decode(message.inputs, LIMITS, payloads, copy=False),
        "targets": decode(message.targets, LIMITS, payloads, copy=False),
    }
    for name, tensor in message.side_inputs.items():
        out[name] = decode(tensor, LIMITS, payloads, copy=False)
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_several_tensors_of_several_mib_round_trip() -> None:
    tensors = _batch()
    wire = TRAIN_STEP.serialize(_train_request(tensors))
    assert len(wire) > 9 * MIB
    incoming = TRAIN_STEP.parse(wire)
    assert isinstance(incoming, Incoming)
    assert incoming.message.request_id == "r" and not incoming.message.payloads
    _assert_same(_decoded(incoming), tensors)


def test_received_tensors_are_views_of_the_received_bytes() -> None:
    tensors = _batch()
    wire = TRAIN_STEP.serialize(_train_request(tensors))
    incoming = TRAIN_STEP.parse(wire)
    assert isinstance(incoming, Incoming)
    assert all(view.obj is wire for view in incoming.payloads)
    inputs = decode(incoming.message.inputs, LIMITS, incoming.payloads, copy=False)
    address = ctypes.cast(wire, ctypes.c_void_p).value
    assert address is not None
    assert address <= inputs.data_ptr() < address + len(wire)  # no copy
    copied = decode(incoming.message.inputs, LIMITS, incoming.payloads, copy=True)
    assert not address <= copied.data_ptr() < address + len(wire)
    copied.add_(1)  # a copy of its own is writable, and the request is untouched
    assert torch.equal(
        decode(incoming.message.inputs, LIMITS, incoming.payloads), tensors["inputs"]
    )


def test_the_bytes_are_an_ordinary_encoding_both_ways() -> None:
    tensors = _batch()
    wire = TRAIN_STEP.serialize(_train_request(tensors))
    # Protobuf reads them: the payloads are the message's own field.
    plain = coordinator_pb2.TrainStepRequest.FromString(wire)
    assert len(plain.payloads) == 5
    _assert_same(_decoded(TRAIN_STEP.received(plain)), tensors)
    # And a request built the old way (bytes in Tensor.data) is read as before.
    old = coordinator_pb2.TrainStepRequest(
        job_id="j",
        inputs=encode(tensors["inputs"]),
        targets=encode(tensors["targets"]),
        side_inputs={n: encode(tensors[n]) for n in ("bf16", "empty", "mask")},
    )
    incoming = TRAIN_STEP.parse(old.SerializeToString())
    assert isinstance(incoming, Incoming) and not incoming.payloads
    _assert_same(_decoded(incoming), tensors)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(0, 300), max_size=6),
    job=st.text(max_size=20),
    run_id=st.integers(0, 2**64 - 1),
)
def test_run_step_round_trip_agrees_with_protobuf(sizes: list[int], job: str, run_id: int) -> None:
    payloads = Payloads()
    inputs = [torch.arange(size, dtype=torch.int16) for size in sizes]
    message = stage_pb2.RunStepRequest(
        job_id=job, run_id=run_id, inputs=[payloads.tensor(t) for t in inputs]
    )
    wire = RUN_STEP.serialize(RUN_STEP.outgoing(message, payloads))
    expected = stage_pb2.RunStepRequest()
    expected.CopyFrom(message)
    expected.payloads.extend(bytes(v) for v in payloads.views)
    assert stage_pb2.RunStepRequest.FromString(wire) == expected
    incoming = RUN_STEP.parse(wire)
    assert isinstance(incoming, Incoming) and incoming.message == message
    for sent, tensor in zip(inputs, incoming.message.inputs, strict=True):
        assert torch.equal(decode(tensor, LIMITS, incoming.payloads, copy=False), sent)


def test_a_payload_index_out_of_range_is_refused() -> None:
    payloads = Payloads()
    tensor = payloads.tensor(torch.ones(4))
    tensor.payload = 1
    with pytest.raises(WireFormatError, match="names payload 1; the request carries 1 payloads"):
        decode(tensor, LIMITS, payloads.views)


def test_a_header_larger_than_its_payload_is_refused() -> None:
    payloads = Payloads()
    tensor = payloads.add(
        common_pb2.TensorHeader(dtype=common_pb2.FLOAT32, shape=[4], num_bytes=16, num_frames=1),
        memoryview(bytes(12)),
    )
    with pytest.raises(WireFormatError, match="payload 0 is 12 bytes; header says 16"):
        decode(tensor, LIMITS, payloads.views)


def test_a_header_that_does_not_add_up_is_refused_before_its_payload_is_read() -> None:
    header = common_pb2.TensorHeader(
        dtype=common_pb2.FLOAT32, shape=[1 << 20], num_bytes=1 << 22, num_frames=1
    )
    tensor = common_pb2.Tensor(header=header, payload=0)
    with pytest.raises(ResourceExhaustedError, match="1048576 elements"):
        decode(tensor, CodecLimits(max_elements=1000), [memoryview(b"")])
    tensor.header.num_bytes = 8
    with pytest.raises(WireFormatError, match="num_bytes 8 does not match"):
        decode(tensor, LIMITS, [memoryview(bytes(8))])


def test_data_and_a_payload_at_once_are_refused() -> None:
    tensor = encode(torch.ones(2))
    tensor.payload = 0
    with pytest.raises(WireFormatError, match="names payload 0 and carries 8 bytes of data"):
        decode(tensor, LIMITS, [memoryview(bytes(8))])


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (-1, "runs 1 bytes past the end"),
        (-(MIB // 2), "past the end"),
    ],
)
def test_a_truncated_request_is_a_typed_error(cut: int, match: str) -> None:
    wire = TRAIN_STEP.serialize(_train_request(_batch()))
    result = TRAIN_STEP.parse(wire[:cut])
    assert isinstance(result, WireFormatError) and match in str(result)
    with pytest.raises(WireFormatError, match="TrainStepRequest"):
        TRAIN_STEP.received(result)


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"\x0b\x00", "unsupported wire type 3"),  # a group
        (b"\x00\x00", "field number 0"),
        (b"\x08" + b"\xff" * 11, "truncated or overlong varint"),
        (b"\x32\x05abc", "runs 2 bytes past the end"),  # payloads field cut short
        (b"\x12\x03abc", "does not parse"),  # inputs is not a Tensor
    ],
)
def test_malformed_requests_are_typed_errors(wire: bytes, match: str) -> None:
    result = TRAIN_STEP.parse(wire)
    assert isinstance(result, WireFormatError)
    assert match in str(result)


def test_an_outgoing_message_with_payloads_of_its_own_is_refused() -> None:
    message = coordinator_pb2.TrainStepRequest(payloads=[b"x"])
    with pytest.raises(ValueError, match="beside the message"):
        TRAIN_STEP.serialize(Outgoing(message, []))


def test_the_coordinator_reads_a_step_as_views_and_digests_it_as_sent() -> None:
    tensors = _batch()
    outgoing = _train_request(tensors)
    incoming = TRAIN_STEP.parse(TRAIN_STEP.serialize(outgoing))
    step = train_batch(incoming, LIMITS)
    assert (step.job_id, step.request_id) == ("j", "r")
    _assert_same(
        {"inputs": step.inputs, "targets": step.targets, **step.side},
        tensors,
    )
    # The same batch sent the old way digests the same: a retry may come either way.
    old = coordinator_pb2.TrainStepRequest(
        job_id="j",
        inputs=encode(tensors["inputs"]),
        targets=encode(tensors["targets"]),
        side_inputs={n: encode(tensors[n]) for n in ("bf16", "empty", "mask")},
        request_id="r",
    )
    assert step.digest() == batch_digest(old) == train_batch(old, LIMITS).digest()
    changed = dict(tensors, mask=torch.zeros(3, 5, dtype=torch.bool))
    other = TRAIN_STEP.parse(TRAIN_STEP.serialize(_train_request(changed)))
    assert train_batch(other, LIMITS).digest() != step.digest()


def test_a_forward_needs_inputs() -> None:
    with pytest.raises(InvalidArgumentError, match="forward needs inputs"):
        forward_batch(coordinator_pb2.ForwardRequest(job_id="j"), LIMITS)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(value=st.integers(1, 2**64 - 1))
def test_varints_agree_with_protobuf(value: int) -> None:
    encoded = varint(value)
    assert encoded == common_pb2.TensorHeader(num_bytes=value).SerializeToString()[1:]
    assert read_varint(memoryview(encoded), 0, "x") == (value, len(encoded))


def test_fields_are_walked_in_order() -> None:
    message = stage_pb2.RunStepRequest(job_id="j", run_id=300, loss_weights=[0.5])
    wire = memoryview(message.SerializeToString())
    assert [(f.number, f.wire_type) for f in fields(wire, "x")] == [(1, 2), (3, 0), (8, 2)]
