"""Server limits on what a peer may send or start, with safe defaults (no gRPC here)."""

from __future__ import annotations

from dataclasses import dataclass

from pipesvc.core.tensor_codec import STREAM_FRAME_BYTES, CodecLimits
from pipesvc.errors import InvalidArgumentError

MAX_MICROBATCHES = 4096
"""Most micro-batches in one run: a job's ``num_microbatches``, checked by the client, the
coordinator and every stage, and what each stage's mailbox is sized for.

Why not more: a run costs a fixed ~0.1-0.3 ms of Python per micro-batch and action on every
stage, so past a few thousand micro-batches the pipeline's bubble, (p-1)/(m+p-1), is no longer
what limits a step; and a GPipe stage keeps every micro-batch's activation alive until its
backward, and the shared-memory ring places each slot in time linear in the slots it holds,
so such a run costs O(m^2) there (one GPipe step of one-row micro-batches over 2 stages: 4096
take ~3 s, 8192 ~11 s, 16384 ~90 s, or ~13 s with the shared-memory path off). A test trains
one step at exactly this many."""

MAX_DECODE_STEPS = 64
"""Most decode steps one generation run may take on the stages (see [Note: decode steps
on the stages] in ``pipesvc.coordinator.session``)."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"1.5G"`` or ``"1000000"`` as a byte count.

    Raises:
        InvalidArgumentError: not a positive size with a known unit.
    """
    stripped = text.strip().lower()
    number = stripped.rstrip("kmgtib")
    unit = stripped[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise InvalidArgumentError(
            f"size {text!r} is not understood; expected e.g. 8GiB, 512MiB, 1.5G or 1000000"
        ) from None
    if not value > 0 or value != value or value == float("inf"):
        raise InvalidArgumentError(f"size {text!r} must be positive")
    return int(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """Every bound a server enforces; exceeding one gets RESOURCE_EXHAUSTED."""

    max_message_bytes: int = 256 << 20
    """Largest gRPC message, in either direction (control calls carry whole batches)."""
    max_tensor_bytes: int = 4 << 30
    """Largest tensor payload (a framed tensor may exceed one message)."""
    max_tensor_elements: int = 1 << 31
    """Most elements in one tensor."""
    max_frames_per_tensor: int = 1 << 16
    """Most frames one tensor may be split into."""
    max_concurrent_rpcs: int = 64
    """Unary calls served at once; more are refused, never queued without bound."""
    max_concurrent_streams: int = 256
    """Streaming calls served at once, each holding a server thread while it runs: a stage's
    links, control streams and state transfers; the coordinator's training streams, state
    transfers and generation sessions from Python clients (one each; the stages' KV budgets
    bound how many sessions fit)."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"limit {name} must be a positive int; got {value!r}")
        if self.max_message_bytes >= 1 << 31:
            raise InvalidArgumentError(
                f"max_message_bytes ({self.max_message_bytes}) must be below 2 GiB (gRPC's bound)"
            )

    def codec(self) -> CodecLimits:
        """The per-tensor part, for the codec."""
        return CodecLimits(
            max_tensor_bytes=self.max_tensor_bytes,
            max_elements=self.max_tensor_elements,
            max_frames=self.max_frames_per_tensor,
            max_frame_bytes=max(1, min(STREAM_FRAME_BYTES, self.max_message_bytes // 2)),
        )
