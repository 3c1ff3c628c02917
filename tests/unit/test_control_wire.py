"""Unit tests for pipesvc.wire.control_wire: a run's payloads beside the message, replies around
a response, and errors that come back as the class and message a unary call raises."""

from __future__ import annotations

import grpc
import pytest
import torch

from pipesvc import errors
from pipesvc.errors import ALL_ERRORS, PipesvcError
from pipesvc.v1 import stage_pb2
from pipesvc.wire.control_wire import (
    Unreadable,
    failed,
    ok,
    parse_request,
    reply_bytes,
    reply_error,
    request_bytes,
)
from pipesvc.wire.payload_wire import Payloads
from pipesvc.wire.rpc_status import error_from_status, error_metadata, status_code


def test_a_run_parses_back_with_its_payloads_as_views_of_the_received_bytes() -> None:
    payloads = Payloads()
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    run = stage_pb2.RunStepRequest(
        job_id="j", plan_epoch=2, run_id=7, num_microbatches=1, inputs=[payloads.tensor(tensor)]
    )
    data = request_bytes(41, "run", run, payloads.views)
    parsed = parse_request(data)
    assert not isinstance(parsed, Unreadable)
    assert parsed.message.id == 41 and parsed.message.WhichOneof("kind") == "run"
    assert parsed.message.run == run
    (payload,) = parsed.payloads
    assert bytes(payload) == tensor.numpy().tobytes()
    assert payload.obj is data  # a view of the received bytes, not a copy
    # Plain protobuf reads the same bytes as one message with its payloads.
    plain = stage_pb2.ControlRequest.FromString(data)
    assert plain.run == run and list(plain.payloads) == [tensor.numpy().tobytes()]


def test_a_run_that_carries_its_own_payloads_is_refused() -> None:
    with pytest.raises(ValueError, match="beside the message"):
        request_bytes(1, "run", stage_pb2.RunStepRequest(payloads=[b"x"]))


def test_unreadable_messages_keep_their_id_when_it_can_be_read() -> None:
    with_id = parse_request(b"\x08\x05\x12\xff")
    assert isinstance(with_id, Unreadable) and with_id.message_id == 5
    assert isinstance(with_id.error, errors.WireFormatError)
    without = parse_request(b"\xff\xff")
    assert isinstance(without, Unreadable) and without.message_id == 0


def test_a_reply_wraps_the_response_as_a_control_reply() -> None:
    response = stage_pb2.RunStepResponse(losses=[0.5, 0.25], grad_norm_sq=3.0)
    reply = stage_pb2.ControlReply.FromString(reply_bytes(ok(9, "run", response)))
    assert reply.id == 9 and reply.WhichOneof("result") == "run" and reply.run == response
    empty = stage_pb2.ControlReply.FromString(
        reply_bytes(ok(10, "abort", stage_pb2.AbortResponse()))
    )
    assert empty.WhichOneof("result") == "abort"


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=[c.__name__ for c in ALL_ERRORS])
def test_every_error_class_comes_back_as_itself(cls: type[PipesvcError]) -> None:
    error = (
        cls("gone", ["s1", "s2"])
        if issubclass(cls, errors.SessionCacheLostError)
        else cls("a message naming the value")
    )
    reply = stage_pb2.ControlReply.FromString(reply_bytes(failed(3, error)))
    assert reply.id == 3 and reply.WhichOneof("result") == "error"
    back = reply_error(reply, "stage x")
    # What the unary call would raise: its status, message and trailing metadata.
    unary = error_from_status(status_code(error), str(error), error_metadata(error), "stage x")
    assert type(back) is type(unary) is cls
    assert str(back) == str(unary) == str(error)
    if isinstance(error, errors.SessionCacheLostError):
        assert isinstance(back, errors.SessionCacheLostError)
        assert list(back.sessions) == ["s1", "s2"]


def test_an_error_without_a_class_name_is_typed_by_its_code_and_named() -> None:
    reply = stage_pb2.ControlReply(
        id=1,
        error=stage_pb2.ControlError(code=grpc.StatusCode.UNAVAILABLE.value[0], message="down"),
    )
    error = reply_error(reply, "stage x")
    assert type(error) is errors.StageUnavailableError and str(error) == "stage x: down"
