"""Requests that carry a batch's tensors, their bytes beside the message, not through protobuf.

[Note: payload wire] A step's batch crosses two hops: the client's TrainStep (or Forward) to the
coordinator, and the coordinator's RunStep to each stage (inputs to rank 0, targets to the last
rank, side inputs to every rank). Building a ``Tensor`` message with its ``data`` copies the
tensor's bytes into the message, serializing copies them again, and parsing and decoding copy
them twice more on the other side; at a few MiB per step that was most of the time between a
client's call and the first forward. So these requests carry their tensors' bytes in a
top-level ``repeated bytes payloads`` field, and each ``Tensor`` holds only its header and the
index of its payload (``Tensor.payload``). The sender serializes the message without payloads
(small) and appends each payload as a field of its own whose value is a view of the tensor's
memory: one ``join``, the only copy before gRPC's own. The receiver walks the top-level fields
(``proto_fields``): each payload becomes a zero-copy view of the received bytes, and protobuf
parses the rest. Protobuf allows fields in any order and repeated fields to be split, so the
bytes are an ordinary encoding of the message, and either end may still use plain protobuf (an
old client's ``Tensor.data`` is accepted as before).

On the coordinator a payload's tensor is a read-only view of the received bytes (it never
writes to a batch): the micro-batches are dimension-0 slices of it, which are contiguous byte
ranges, so each stage's RunStep appends views of the same bytes, and the step log and the
request digest read them where they lie. A stage makes a writable copy only of what its layers
may write to (see ``StageService.RunStep``). ``tensor_codec.decode`` checks every header
against the receiver's limits and the payload's length against the header, so a request never
makes a receiver allocate more than it declared and received.

A parse failure is not raised in gRPC's deserializer (gRPC would answer UNKNOWN or INTERNAL
and log a traceback): ``parse`` returns the error, and the handler raises it as a typed
``WireFormatError`` (``received``). No gRPC here: the functions are the methods' serializers
and deserializers (see ``transport.add_service`` and ``transport.unary_method``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from google.protobuf.message import DecodeError, Message

from pipesvc.core.tensor_codec import payload_view
from pipesvc.errors import WireFormatError
from pipesvc.v1 import common_pb2, coordinator_pb2, stage_pb2
from pipesvc.wire.proto_fields import LENGTH_DELIMITED, fields, tag, varint

M = TypeVar("M", bound=Message)
FIELD_NAME = "payloads"
"""The request field that holds the payloads (its number is the message's own)."""


class Payloads:
    """The payloads of one request being built, in order; each tensor added gets the
    ``Tensor`` message that names its payload."""

    def __init__(self) -> None:
        self.views: list[memoryview] = []

    def add(self, header: common_pb2.TensorHeader, view: memoryview) -> common_pb2.Tensor:
        """Appends ``view`` (the bytes ``header`` describes); returns the message naming it."""
        self.views.append(view)
        return common_pb2.Tensor(header=header, payload=len(self.views) - 1)

    def tensor(self, tensor: torch.Tensor) -> common_pb2.Tensor:
        """Appends a view of ``tensor``'s memory (no copy of a contiguous CPU tensor, which must
        not change until the request is sent); returns the message naming it."""
        return self.add(*payload_view(tensor))


@dataclass(frozen=True, slots=True)
class Outgoing(Generic[M]):
    """A request to send: ``message`` without payloads, and the payloads to append."""

    message: M
    payloads: Sequence[memoryview]


@dataclass(frozen=True, slots=True)
class Incoming(Generic[M]):
    """A received request: ``message`` without payloads, and views of its payloads in the
    received bytes (read-only)."""

    message: M
    payloads: Sequence[memoryview]


class PayloadWire(Generic[M]):
    """How requests of one message type travel: its ``payloads`` field beside the message."""

    def __init__(self, message_class: type[M]) -> None:
        self.message_class = message_class
        self.name = message_class.DESCRIPTOR.name
        self.field = message_class.DESCRIPTOR.fields_by_name[FIELD_NAME].number
        self._tag = tag(self.field, LENGTH_DELIMITED)

    def outgoing(self, message: M, payloads: Payloads) -> Outgoing[M]:
        """``message`` (whose tensors ``payloads`` built) with its payloads, to send."""
        return Outgoing(message, tuple(payloads.views))

    def serialize(self, item: Outgoing[M] | M) -> bytes:
        """Wire bytes of a request (the method's request serializer): the message, then each
        payload as one field whose value is the view itself.

        Raises:
            ValueError: an outgoing message also has payloads of its own (their indices would
                be ambiguous).
        """
        if not isinstance(item, Outgoing):
            data: bytes = item.SerializeToString()
            return data
        head = item.message.SerializeToString()
        if getattr(item.message, FIELD_NAME):
            raise ValueError(f"an outgoing {self.name} carries its payloads beside the message")
        pieces: list[bytes | memoryview] = [head]
        for view in item.payloads:
            pieces += (self._tag, varint(view.nbytes), view)
        return b"".join(pieces)

    def parse(self, buf: bytes) -> Incoming[M] | WireFormatError:
        """A request from wire bytes, its payloads views of ``buf`` (the method's request
        deserializer); the error, not raised, when ``buf`` is malformed (see ``received``)."""
        view = memoryview(buf)
        what = f"a {self.name}"
        rest: list[memoryview] = []
        payloads: list[memoryview] = []
        try:
            for field in fields(view, what):
                if field.number == self.field and field.wire_type == LENGTH_DELIMITED:
                    payloads.append(view[field.value_start : field.end])
                else:
                    rest.append(view[field.start : field.end])
            message = self.message_class.FromString(b"".join(rest))
        except WireFormatError as exc:
            return exc
        except DecodeError as exc:
            return WireFormatError(f"{what} does not parse: {exc}")
        return Incoming(message, tuple(payloads))

    def received(self, request: Incoming[M] | M | WireFormatError) -> Incoming[M]:
        """What a handler was given, as message and payloads: ``parse``'s result, or a message
        parsed by protobuf (a server registered without this codec, or a direct call), whose
        payloads are then its own ``payloads`` field.

        Raises:
            WireFormatError: the request did not parse.
        """
        if isinstance(request, WireFormatError):
            raise WireFormatError(str(request))
        if isinstance(request, Incoming):
            return request
        own: Sequence[bytes] = getattr(request, FIELD_NAME)
        return Incoming(request, tuple(memoryview(p) for p in own))


TRAIN_STEP = PayloadWire(coordinator_pb2.TrainStepRequest)
"""The client's training step to the coordinator."""
FORWARD = PayloadWire(coordinator_pb2.ForwardRequest)
"""The client's inference batch to the coordinator."""
RUN_STEP = PayloadWire(stage_pb2.RunStepRequest)
"""The coordinator's run to one stage."""
