"""The messages of a Control stream on the wire: runs with their payloads beside the message,
replies built around a response without copying it, errors as a unary call's status.

See [Note: control stream] in ``pipesvc.coordinator.control_stream``. No gRPC calls here: the
functions are the stream's serializers and deserializers, and the two directions of the error
mapping (``rpc_status`` is the one table from error classes to status codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import grpc
from google.protobuf.message import Message

from pipesvc.errors import PipesvcError, WireFormatError
from pipesvc.v1 import stage_pb2
from pipesvc.wire.payload_wire import Incoming, PayloadWire
from pipesvc.wire.proto_fields import LENGTH_DELIMITED, fields, tag, varint
from pipesvc.wire.rpc_status import error_from_status, error_metadata, status_code

Kind: TypeAlias = Literal["run", "commit", "abort"]
"""What a control message carries (the ``kind`` of a ControlRequest)."""
KINDS: tuple[Kind, ...] = ("run", "commit", "abort")

CONTROL = PayloadWire(stage_pb2.ControlRequest)
"""A ControlRequest's payloads (a run's tensors) travel beside it, as a RunStep's do."""

_REQUEST = stage_pb2.ControlRequest.DESCRIPTOR
_REPLY = stage_pb2.ControlReply.DESCRIPTOR
_ID_TAG = tag(_REQUEST.fields_by_name["id"].number, 0)
_REQUEST_TAGS = {k: tag(_REQUEST.fields_by_name[k].number, LENGTH_DELIMITED) for k in KINDS}
_REPLY_TAGS = {k: tag(_REPLY.fields_by_name[k].number, LENGTH_DELIMITED) for k in (*KINDS, "error")}
_PAYLOAD_TAG = tag(CONTROL.field, LENGTH_DELIMITED)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def request_bytes(
    message_id: int, kind: Kind, message: Message, payloads: Sequence[memoryview] = ()
) -> bytes:
    """A ControlRequest's wire bytes: ``id``, ``message`` (a RunStepRequest without payloads,
    a CommitRequest or an AbortRequest) as its ``kind``, then each payload as one field whose
    value is the view itself: one ``join``, the only copy of a tensor's bytes before gRPC's.

    Raises:
        ValueError: a run's message also has payloads of its own.
    """
    if kind == "run" and getattr(message, "payloads", None):
        raise ValueError("a control run carries its payloads beside the message")
    body = message.SerializeToString()
    pieces: list[bytes | memoryview] = [
        _ID_TAG,
        varint(message_id),
        _REQUEST_TAGS[kind],
        varint(len(body)),
        body,
    ]
    for view in payloads:
        pieces += (_PAYLOAD_TAG, varint(view.nbytes), view)
    return b"".join(pieces)


def identity(data: bytes) -> bytes:
    """The request serializer of a stream whose messages are serialized before they queue."""
    return data


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A control message that did not parse: its id when that much could be read (0: not)."""

    message_id: int
    error: WireFormatError


def parse_request(buf: bytes) -> Incoming[stage_pb2.ControlRequest] | Unreadable:
    """A received ControlRequest, its payloads views of ``buf`` (the stage's request
    deserializer), or what could be read of a malformed one (never raised in gRPC's
    deserializer, which would end the stream as UNKNOWN)."""
    parsed = CONTROL.parse(buf)
    if not isinstance(parsed, WireFormatError):
        return parsed
    message_id = 0
    try:
        for field in fields(memoryview(buf), "a ControlRequest"):
            if field.number == 1 and field.wire_type == 0:
                message_id = _varint_value(memoryview(buf)[field.value_start : field.end])
                break
    except WireFormatError:
        pass
    return Unreadable(message_id, parsed)


def _varint_value(view: memoryview) -> int:
    value = 0
    for shift, byte in enumerate(view):
        value |= (byte & 0x7F) << (7 * shift)
    return value


@dataclass(frozen=True, slots=True)
class Reply:
    """A stage's reply to one control message: the response of ``kind``, or ``error``."""

    message_id: int
    kind: Kind | Literal["error"]
    message: Message


def ok(message_id: int, kind: Kind, response: Message) -> Reply:
    """The reply carrying ``response``."""
    return Reply(message_id, kind, response)


def failed(message_id: int, error: PipesvcError) -> Reply:
    """The reply carrying ``error`` as the unary call would end: status code, message, and the
    trailing metadata (class name, lost sessions)."""
    return Reply(
        message_id,
        "error",
        stage_pb2.ControlError(
            code=status_code(error).value[0],
            message=str(error),
            trailing=[stage_pb2.MetadataEntry(key=k, value=v) for k, v in error_metadata(error)],
        ),
    )


def reply_bytes(reply: Reply) -> bytes:
    """A ControlReply's wire bytes around the response's own serialization (the stage's
    response serializer): an inference run's outputs are not copied into a second message."""
    body = reply.message.SerializeToString()
    return b"".join(
        (_ID_TAG, varint(reply.message_id), _REPLY_TAGS[reply.kind], varint(len(body)), body)
    )


def reply_error(reply: stage_pb2.ControlReply, where: str) -> PipesvcError:
    """The typed error a failed reply stands for: the class the unary call would raise, with
    the stage's message (``where`` prefixes it only for an error without a class name, as
    ``error_from_rpc`` does)."""
    error = reply.error
    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    return error_from_status(
        code, error.message or str(code), [(e.key, e.value) for e in error.trailing], where
    )
