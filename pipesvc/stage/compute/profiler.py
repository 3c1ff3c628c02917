"""A stage's own timings of its training runs, for the throughput plan (no gRPC here).

Per layer: forward seconds and output bytes per micro-batch; per stage: backward seconds per
micro-batch, and the rate of its send calls downstream (puts into the sender's queue: not the
link's rate, which ``pipesvc.stage.net.probe`` measures). Each is a running mean that turns into an
exponential one (weight ``RECENT``) once it has that many samples behind it, so it follows a
stage that slows down while it trains.

Times are wall-clock around each call; on a GPU the calls return before the kernels finish,
so there they measure launch time unless the device is synchronised (CPU stages here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from pipesvc.core import quant

RECENT = 0.1
"""Weight of a new sample once a mean has 1 / RECENT samples."""

CALIBRATION_SIZE = 256
"""The calibration product multiplies two CALIBRATION_SIZE-square float32 matrices."""


class _Mean:
    """The mean described above; the very first sample is dropped (the first micro-batch of
    a plan pays for allocation and lazy initialisation)."""

    __slots__ = ("count", "value", "warm")

    def __init__(self) -> None:
        self.count = 0
        self.value = 0.0
        self.warm = False

    def add(self, sample: float) -> None:
        if not self.warm:
            self.warm = True
            return
        self.count += 1
        self.value += (sample - self.value) * max(1.0 / self.count, RECENT)


@dataclass(frozen=True, slots=True)
class LayerTime:
    index: int
    forward_s: float
    backward_s: float
    output_bytes: int
    flops: int


@dataclass(frozen=True, slots=True)
class Profile:
    layers: list[LayerTime]
    microbatches: int
    send_bytes_per_s: float


class StageProfiler:
    """Collects the timings of one stage's training runs (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._forward: dict[int, _Mean] = {}
            self._bytes: dict[int, int] = {}
            self._flops: dict[int, int] = {}
            self._backward = _Mean()
            self._send_rate = _Mean()

    def layer(
        self, index: int, seconds: float, output: torch.Tensor, wire: str | None = None
    ) -> None:
        """A layer's forward time; its output's size as it would cross a link (in ``wire``,
        the codec floating-point activations are sent in, when the job sets one)."""
        self.layers([(index, seconds, output_bytes(output, wire))])

    def layers(self, samples: Iterable[tuple[int, float, int]]) -> None:
        """The layers of one forward: each one's index, forward time and output bytes (see
        ``output_bytes``), under one lock."""
        with self._lock:
            for index, seconds, size in samples:
                mean = self._forward.get(index)
                if mean is None:
                    mean = self._forward[index] = _Mean()
                mean.add(seconds)
                self._bytes[index] = size

    def needs_flops(self, index: int) -> bool:
        """Whether layer ``index``'s operations are still to be counted (once per plan: a
        counted forward runs slower, and it is the warm-up sample that is dropped anyway)."""
        return index not in self._flops

    def counted(self, index: int, flops: int) -> None:
        with self._lock:
            self._flops[index] = flops

    def backward(self, seconds: float) -> None:
        with self._lock:
            self._backward.add(seconds)

    def sent(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            with self._lock:
                self._send_rate.add(nbytes / seconds)

    def snapshot(self) -> Profile:
        with self._lock:
            forward = {i: m.value for i, m in self._forward.items() if m.count}
            total = sum(forward.values())
            backward = self._backward.value
            layers = [
                LayerTime(
                    index=i,
                    forward_s=f,
                    backward_s=backward * f / total if total > 0 else 0.0,
                    output_bytes=self._bytes[i],
                    flops=self._flops.get(i, 0),
                )
                for i, f in sorted(forward.items())
            ]
            return Profile(layers, self._backward.count, self._send_rate.value)


def output_bytes(output: torch.Tensor, wire: str | None = None) -> int:
    """A layer output's size as it would cross a link (in ``wire``, the codec floating-point
    activations are sent in, when the job sets one)."""
    if wire is not None and output.is_floating_point():
        return quant.wire_bytes(output.numel(), wire)
    return output.numel() * output.element_size()


class FlopCount(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the floating-point operations of the ops run inside it with torch's own
    formulas (``torch.utils.flop_counter``'s registry). A dispatch mode is active in its own
    thread only; ``FlopCounterMode`` also tracks modules with process-wide hooks, which another
    stage's thread in the same process would disturb."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def calibrate(seconds: float, device: torch.device) -> float:
    """GFLOP/s of repeated float32 matrix products over ``seconds`` of wall-clock time, on
    this process's torch threads (so a capped CPU or a busy host shows)."""
    n = CALIBRATION_SIZE
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)  # warm-up
    count = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        torch.mm(a, b)
        count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - started
    return 2.0 * n**3 * count / elapsed / 1e9
