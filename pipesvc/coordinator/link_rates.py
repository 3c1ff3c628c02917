"""Probed link rates between hosts, kept for a while (no gRPC).

[Note: link rate cache] A link probe (see [Note: link probe] in ``pipesvc.stage.net.probe``) costs
0.1 to 0.5 s of the link per pair of hosts, and a job measures on every re-plan, settling round
and ``wire_dtype="auto"`` decision, while the rate between two hosts is a property of the
network, not of a job. The coordinator keeps each pair's last probed rate, for every job, for
``max_age_s`` (``MAX_AGE_S`` by default); the measurements a job makes by itself probe only
the pairs it holds no fresh rate for, while a re-plan the user asks for (``Job.replan``)
probes every pair again, and refreshes the rates kept. A pair whose probe failed keeps
nothing, so the next measurement tries it again. A link whose rate changes (a congested
uplink, a host moved) is seen by the automatic measurements within ``max_age_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MAX_AGE_S = 300.0
"""Seconds a probed rate is used before the pair is probed again."""

HostPair = frozenset[str]
"""The two hosts a link joins (either way: a link's two directions share one rate)."""


class LinkRates:
    """The probed rate of each pair of hosts, with when it was probed (thread-safe)."""

    def __init__(
        self, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_age_s = max_age_s
        self._clock = clock
        self._rates: dict[HostPair, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def fresh(self, pair: HostPair) -> float | None:
        """The pair's rate in bytes per second, if probed less than ``max_age_s`` ago."""
        with self._lock:
            found = self._rates.get(pair)
            if found is None:
                return None
            rate, at = found
            if self._clock() - at >= self._max_age_s:
                del self._rates[pair]
                return None
            return rate

    def record(self, pair: HostPair, bytes_per_s: float) -> None:
        """Keeps a rate just probed."""
        with self._lock:
            self._rates[pair] = (bytes_per_s, self._clock())

    def __len__(self) -> int:
        with self._lock:
            return len(self._rates)
