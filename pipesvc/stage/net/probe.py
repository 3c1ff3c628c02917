"""Measuring the link between two stages by sending it filler (the sender's side and the
receiver's bound; the RPCs are ``StageService.ProbeLink`` and ``Sink``).

[Note: link probe] ``wire_dtype="auto"`` compresses a link only where it is the bottleneck
(see [Note: automatic codecs] in ``pipesvc.core.link_codecs``), so it needs each link's rate.
Timing a stage's own sends does not give it: a send is a put into a queue, and below it gRPC's
flow-control windows and the kernel's socket buffers take a whole step's bytes at memory speed
(on a 100 Mbit/s link both the send call and the frame pulls read gigabytes per second). What
a link's rate is, is bytes that *arrived* per second, and only the receiver knows when they
arrived; so the sender A streams ``n`` bytes of filler to the receiver B (``Sink``: a
client-streaming call), B answers once the stream ended with all of them, and A times from its
first byte to that answer. Buffers in between cannot hide anything: the answer waits for the
last byte at B. What the figure also counts is one round trip and gRPC's per-call cost, small
against the size chosen:

- ``n`` starts at ``FIRST_BYTES`` (1 MiB); while a send took under ``MIN_SECONDS`` (50 ms) it
  repeats with 8 times more, up to ``MAX_BYTES`` (64 MiB); the rate is the last send's. So a
  100 Mbit/s link costs one send of about 85 ms, a 1 Gbit/s one about 75 ms more, and a fast
  one at most a 64 MiB send; the longest probe is one just under 50 ms followed by one 8 times
  as long (``next_bytes``).
- Each send opens no new connection for its timing: the probe first makes an empty call on
  the channel (connection, TLS and the token's check happen there), then the timed ones.
- B never holds the filler: it counts each frame's length and drops it, refuses a stream whose
  first frame declares more than ``MAX_BYTES`` (or none), and one that carries more or fewer
  bytes than declared (typed errors, ``InvalidArgumentError``). Each frame is one gRPC message,
  bounded by the server's message limit as every other.

The coordinator's measurement (``Replanner.measure``) asks each stage of a plan for its link to
the next, and one stage per other pair of hosts among the candidates, one probe at a time (two
probes at once would share CPU and links and read each other's load), between two steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc

from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from pipesvc.wire.transport import call

FIRST_BYTES = 1 << 20
"""The first send's size."""
MAX_BYTES = 64 << 20
"""The largest send, and the most a ``Sink`` stream may declare."""
MIN_SECONDS = 0.05
"""A send that took less is too short to trust (a round trip and per-call costs weigh)."""
GROWTH = 8
"""How much larger the next send is."""
FRAME_BYTES = 256 << 10
"""Filler bytes per frame of a ``Sink`` stream (well under any message limit)."""
CALL_TIMEOUT_S = 30.0
"""Deadline of one send: 64 MiB at 20 Mbit/s (a send that large follows one under 50 ms)."""

_FILLER = os.urandom(FRAME_BYTES)
"""Random, so that no compression on the way could shrink it."""


def next_bytes(sent: int, seconds: float) -> int | None:
    """The size of the next send after one of ``sent`` bytes took ``seconds``, or None when that
    send is the measurement (it was long enough, or as large as allowed)."""
    if seconds >= MIN_SECONDS or sent >= MAX_BYTES:
        return None
    return min(MAX_BYTES, sent * GROWTH)


def sink_frames(total: int) -> Iterator[stage_pb2.SinkFrame]:
    """A ``Sink`` stream of ``total`` filler bytes (the first frame declares ``total``; an empty
    stream of one frame when it is 0)."""
    first = True
    left = total
    while first or left > 0:
        size = min(left, FRAME_BYTES)
        chunk = _FILLER if size == FRAME_BYTES else _FILLER[:size]
        yield stage_pb2.SinkFrame(total_bytes=total if first else 0, filler=chunk)
        first = False
        left -= size


def receive(frames: Iterable[stage_pb2.SinkFrame], *, max_bytes: int = MAX_BYTES) -> int:
    """Counts a ``Sink`` stream's filler, dropping it as it comes; the bytes received.

    Raises:
        InvalidArgumentError: the stream is empty, its first frame declares no size or more
            than ``max_bytes``, a later frame declares one, or it carries more or fewer bytes
            than declared.
    """
    declared: int | None = None
    received = 0
    for frame in frames:
        if declared is None:
            if not frame.total_bytes or frame.total_bytes > max_bytes:
                raise InvalidArgumentError(
                    f"a link probe declares {frame.total_bytes} bytes; expected 1 to {max_bytes}"
                )
            declared = frame.total_bytes
        elif frame.total_bytes:
            raise InvalidArgumentError(
                f"a link probe frame after the first declares {frame.total_bytes} bytes; only "
                "the first declares the size"
            )
        received += len(frame.filler)
        if received > declared:
            raise InvalidArgumentError(
                f"a link probe sent more than the {declared} bytes it declared"
            )
    if declared is None:
        raise InvalidArgumentError("a link probe sent no frame; expected its size first")
    if received != declared:
        raise InvalidArgumentError(
            f"a link probe ended after {received} of the {declared} bytes it declared"
        )
    return received


@dataclass(frozen=True, slots=True)
class Measured:
    """A probe's answer: the last send's rate, bytes and seconds, and how many sends."""

    bytes_per_s: float
    bytes: int
    seconds: float
    rounds: int


def probe(channel: grpc.Channel, target: str) -> Measured:
    """Measures the link to the stage on ``channel`` (at ``target``, for errors) as [Note: link
    probe] says.

    Raises:
        PipesvcError: the target did not answer or refused a send.
    """
    stub = stage_pb2_grpc.StageServiceStub(channel)
    where = f"link probe to {target}"
    # An untimed call first: it opens the connection (TLS, the token's check).
    call(stub.Sink, sink_frames(1), timeout_s=CALL_TIMEOUT_S, where=where)
    size: int | None = FIRST_BYTES
    rounds = 0
    sent, seconds = 0, 0.0
    while size is not None:
        started = time.perf_counter()
        call(stub.Sink, sink_frames(size), timeout_s=CALL_TIMEOUT_S, where=where)
        sent, seconds = size, max(time.perf_counter() - started, 1e-9)
        rounds += 1
        size = next_bytes(sent, seconds)
    return Measured(sent / seconds, sent, seconds, rounds)
