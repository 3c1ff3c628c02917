"""A stage's record of its runs: timed actions for traces, and the figures derived from them.

Pure Python; the service calls ``span`` around every wait, compute and send of a run.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.observe.trace import COMPUTE_EVENTS, TraceEvent

logger = logging.getLogger(__name__)


_Event = tuple[int, int, str, int, int, int]
"""A recorded span as kept: run id, step, name, micro-batch, start and end (ns)."""


class RunRecorder:
    """Keeps the newest ``max_events`` events and a window of recent runs' throughput.

    [Note: cheap spans] A stage records two or three spans per schedule action, so a span costs
    what a tiny model's action is worth unless kept small: ``span`` is a slotted object, not a
    generator-based context manager, and an event is kept as a plain tuple, made a validated
    ``TraceEvent`` only when ``events`` is read (a trace is read rarely, a span is made per
    action).
    """

    def __init__(
        self, metrics: Metrics = NO_METRICS, max_events: int = 50_000, window_runs: int = 10
    ) -> None:
        self._metrics = metrics
        self._events: collections.deque[_Event] = collections.deque(maxlen=max_events)
        self._window: collections.deque[tuple[int, float]] = collections.deque(maxlen=window_runs)
        self._lock = threading.Lock()
        self._run = (0, 0)
        self._context: dict[str, object] = {}
        self._run_start_ns = 0
        self._busy_ns = 0
        self._computed = 0

    def begin(self, run_id: int, step: int, *, job_id: str = "", rank: int = 0) -> None:
        """Starts recording a run (``step`` is 0 for inference)."""
        self._run = (run_id, step)
        self._context = {"job": job_id, "step": step, "rank": rank}
        self._run_start_ns = time.time_ns()
        self._busy_ns = 0
        self._computed = 0

    def span(self, name: str, microbatch: int) -> _Span:
        """Times the enclosed action as an event of the current run (``name`` is one of
        ``EVENT_NAMES``), also when it raises."""
        return _Span(self, name, microbatch)

    def record(self, name: str, microbatch: int, start: int, end: int) -> None:
        """Records an event of the current run from ``start`` to ``end`` (``time.time_ns()``)."""
        run_id, step = self._run
        with self._lock:
            self._events.append((run_id, step, name, microbatch, start, end))
        seconds = (end - start) / 1e9
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s of micro-batch %d took %.2f ms",
                name,
                microbatch,
                seconds * 1e3,
                extra={**self._context, "microbatch": microbatch},
            )
        if name in COMPUTE_EVENTS:
            self._busy_ns += end - start
            self._computed += 1
            self._metrics.observe("action_seconds", seconds, action=name)
        elif name == "wait":
            self._metrics.observe("wait_seconds", seconds, kind="input")

    def end(self, *, training: bool, generating: bool = False) -> None:
        """Finishes the run: throughput window, bubble gauge and run counter."""
        span_ns = max(1, time.time_ns() - self._run_start_ns)
        with self._lock:
            self._window.append((self._computed, span_ns / 1e9))
        mode = "train" if training else "generate" if generating else "infer"
        self._metrics.inc("runs_total", mode=mode)
        if training:
            self._metrics.set("bubble_fraction", 1.0 - min(1.0, self._busy_ns / span_ns))

    def events(self, max_runs: int = 0) -> list[TraceEvent]:
        """Events of the newest ``max_runs`` runs (all kept with 0), oldest first."""
        with self._lock:
            kept = list(self._events)
        if max_runs:
            runs = sorted({e[0] for e in kept})[-max_runs:]
            keep = set(runs)
            kept = [e for e in kept if e[0] in keep]
        return [
            TraceEvent(
                run_id=run_id,
                step=step,
                name=name,
                microbatch=microbatch,
                start_ns=start,
                end_ns=max(start, end),  # the wall clock may step back mid-span
            )
            for run_id, step, name, microbatch, start, end in kept
        ]

    @property
    def microbatches_per_s(self) -> float:
        """Compute actions per second over the recent runs (0 before any)."""
        with self._lock:
            actions = sum(n for n, _ in self._window)
            seconds = sum(s for _, s in self._window)
        return actions / seconds if seconds > 0 else 0.0


class _Span:
    """One timed span (see [Note: cheap spans]): a context manager without a generator."""

    __slots__ = ("_microbatch", "_name", "_recorder", "_start")

    def __init__(self, recorder: RunRecorder, name: str, microbatch: int) -> None:
        self._recorder = recorder
        self._name = name
        self._microbatch = microbatch
        self._start = 0

    def __enter__(self) -> None:
        self._start = time.time_ns()

    def __exit__(self, *exc: object) -> None:
        self._recorder.record(self._name, self._microbatch, self._start, time.time_ns())
