"""Server limits on what a peer may send or start, with safe defaults (no gRPC here)."""

from __future__ import annotations

from dataclasses import dataclass

from pipesvc.errors import InvalidArgumentError
from pipesvc.tensor_codec import CodecLimits


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
    max_concurrent_streams: int = 16
    """Streaming calls (data plane, state transfer) served at once."""

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
        )
