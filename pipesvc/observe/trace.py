"""Stage schedule traces: Chrome trace JSON, a PNG timeline and busy/idle analysis."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipesvc.errors import InvalidArgumentError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "COMPUTE_EVENTS",
    "EVENT_NAMES",
    "StageTimeline",
    "TraceEvent",
    "busy_idle",
    "chrome_trace",
    "ideal_bubble",
    "order_of",
    "plot_timeline",
    "run_spans",
    "runs_label",
    "timeline_figure",
    "write_chrome_trace",
    "write_trace_files",
]

EVENT_NAMES: tuple[str, ...] = ("forward", "backward", "weight", "wait", "send", "reduce")
"""Event names a stage records; forward, backward and weight are compute, the rest are not
(``reduce`` is the gradient sum with the other replicas, see [Note: gradient group])."""

_COMPUTE = {"forward": "F", "backward": "B", "weight": "W"}
COMPUTE_EVENTS: tuple[str, ...] = tuple(_COMPUTE)
"""The event names that are compute (a stage is busy during them)."""
_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "weight": "#c44e52",
    "wait": "#d9d9d9",
    "send": "#7f7f7f",
    "reduce": "#8172b3",
}
BETWEEN_RUNS = "between steps: coordinator (commit, step log, next batch)"
"""What the shaded gaps of the PNG are: no stage runs a schedule there."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceEvent:
    """One timed interval of a stage's schedule.

    Raises:
        InvalidArgumentError: If ``name`` is unknown, ``end_ns < start_ns`` or ``microbatch``
            is negative; the message shows the event.
    """

    run_id: int
    """Unique, increasing run number (a training step or an inference pass)."""
    step: int
    """Training step number (0 for inference runs)."""
    name: str
    """One of :data:`EVENT_NAMES`; ``"wait"`` is blocked on an activation or gradient."""
    microbatch: int
    """Micro-batch index within the run, from 0."""
    start_ns: int
    """Start, ``time.time_ns()`` wall clock of the recording host."""
    end_ns: int
    """End, same clock; at least ``start_ns``."""

    def __post_init__(self) -> None:
        if self.name not in EVENT_NAMES:
            raise InvalidArgumentError(f"{self!r}: name must be one of {', '.join(EVENT_NAMES)}")
        if self.end_ns < self.start_ns:
            raise InvalidArgumentError(
                f"{self!r}: end_ns ({self.end_ns}) is before start_ns ({self.start_ns})"
            )
        if self.microbatch < 0:
            raise InvalidArgumentError(f"{self!r}: microbatch ({self.microbatch}) is negative")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTimeline:
    """Every recorded event of one stage server.

    Raises:
        InvalidArgumentError: If ``rank`` is negative.
    """

    rank: int
    """Stage index, from 0."""
    address: str
    """Server address, for labels."""
    events: tuple[TraceEvent, ...]
    """Events in any order."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise InvalidArgumentError(f"timeline rank ({self.rank}) is negative")


def _checked(timelines: Sequence[StageTimeline]) -> list[StageTimeline]:
    """Returns the timelines sorted by rank; ranks must be distinct."""
    ordered = sorted(timelines, key=lambda t: t.rank)
    ranks = [t.rank for t in ordered]
    if len(set(ranks)) != len(ranks):
        raise InvalidArgumentError(f"timelines repeat a rank: {ranks}")
    return ordered


def _origin_ns(events: Iterable[TraceEvent]) -> int:
    return min((e.start_ns for e in events), default=0)


def _label(event: TraceEvent) -> str:
    letter = _COMPUTE.get(event.name)
    return f"{letter}{event.microbatch}" if letter else f"{event.name} {event.microbatch}"


def chrome_trace(timelines: Sequence[StageTimeline]) -> dict[str, object]:
    """Returns the timelines in the Chrome Trace Event Format (Perfetto, chrome://tracing).

    One process per stage (``pid`` = rank), thread 0 for forward/backward, thread 1 for waits
    and sends; ``ts``/``dur`` in microseconds from the earliest event. Hosts' clocks are not
    reconciled, so cross-stage alignment is only as good as their clock sync.

    Raises:
        InvalidArgumentError: If two timelines share a rank.
    """
    ordered = _checked(timelines)
    origin = _origin_ns(e for t in ordered for e in t.events)
    meta: list[dict[str, object]] = []
    spans: list[dict[str, object]] = []
    for t in ordered:
        meta.append(_meta("process_name", t.rank, 0, {"name": f"rank {t.rank} ({t.address})"}))
        meta.append(_meta("process_sort_index", t.rank, 0, {"sort_index": t.rank}))
        meta.append(_meta("thread_name", t.rank, 0, {"name": "compute"}))
        meta.append(_meta("thread_name", t.rank, 1, {"name": "wait/send"}))
        for e in sorted(t.events, key=lambda e: (e.start_ns, e.end_ns)):
            args = {"run_id": e.run_id, "step": e.step, "microbatch": e.microbatch}
            tid = 0 if e.name in _COMPUTE else 1
            span = {"name": _label(e), "cat": e.name, "ph": "X", "pid": t.rank, "tid": tid}
            ts_us, dur_us = (e.start_ns - origin) / 1000, (e.end_ns - e.start_ns) / 1000
            spans.append({**span, "ts": ts_us, "dur": dur_us, "args": args})
    return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}


def _meta(name: str, pid: int, tid: int, args: dict[str, object]) -> dict[str, object]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_chrome_trace(timelines: Sequence[StageTimeline], path: str | os.PathLike[str]) -> None:
    """Writes :func:`chrome_trace` of the timelines to ``path`` as JSON.

    Raises:
        InvalidArgumentError: If two timelines share a rank.
    """
    trace = chrome_trace(timelines)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(trace, file)


@dataclass(frozen=True, slots=True)
class RunSpan:
    """One run across every stage: from its first event's start to its last event's end."""

    run_id: int
    step: int
    """Training step (0 for an inference run)."""
    start_ns: int
    end_ns: int


def run_spans(timelines: Sequence[StageTimeline]) -> list[RunSpan]:
    """Every run's span over all stages, in run order."""
    spans: dict[int, RunSpan] = {}
    for e in (e for t in timelines for e in t.events):
        old = spans.get(e.run_id)
        start = e.start_ns if old is None else min(old.start_ns, e.start_ns)
        end = e.end_ns if old is None else max(old.end_ns, e.end_ns)
        spans[e.run_id] = RunSpan(e.run_id, e.step, start, end)
    return [spans[r] for r in sorted(spans)]


def runs_label(timelines: Sequence[StageTimeline]) -> str:
    """``"steps 3 to 7"``, ``"step 3 and 1 inference run"``: what a trace shows."""
    spans = run_spans(timelines)
    steps = sorted({s.step for s in spans if s.step > 0})
    inference = sum(1 for s in spans if s.step == 0)
    parts = []
    if steps:
        contiguous = steps == list(range(steps[0], steps[-1] + 1))
        if len(steps) == 1:
            parts.append(f"step {steps[0]}")
        elif contiguous:
            parts.append(f"steps {steps[0]} to {steps[-1]}")
        else:
            parts.append("steps " + ", ".join(map(str, steps)))
    if inference:
        parts.append(f"{inference} inference run{'s' if inference > 1 else ''}")
    return " and ".join(parts) or "no runs"


def timeline_figure(timelines: Sequence[StageTimeline], *, title: str = "") -> Figure:
    """The timeline as a matplotlib Figure (on an Agg canvas, never pyplot); see plot_timeline.

    The title line is ``title`` followed by the steps shown. Each run's span is labelled
    with its step above the rows, and the gaps between runs, where no stage has work because
    the coordinator commits, logs and sends the next batch, are shaded and labelled.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ordered = _checked(timelines)
    events = [e for t in ordered for e in t.events]
    origin = _origin_ns(events)
    span_ms = max((max((e.end_ns for e in events), default=0) - origin) / 1e6, 1e-3)
    width_in, dpi, left, right = 12.0, 100, 0.14, 0.98
    # The legend has its own row under the time axis (above the plot it ran into a long
    # title): 0.55 in for the ticks and the axis label, then 0.35 in for the legend.
    legend_in = 0.35
    height_in = 1.6 + legend_in + 0.55 * max(len(ordered), 1)
    figure = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(figure)
    figure.subplots_adjust(
        left=left, right=right, bottom=(0.55 + legend_in) / height_in, top=1 - 1.0 / height_in
    )
    ax = figure.add_subplot()
    # Rough width of one 7 pt digit, in ms of x axis, to skip labels that would spill over.
    char_ms = 0.6 * 7 / 72 * span_ms / ((right - left) * width_in)
    for row, t in enumerate(ordered):
        _draw_row(ax, row, t.events, origin, char_ms)
    _draw_runs(ax, run_spans(ordered), origin, len(ordered), char_ms)
    ax.set_yticks(range(len(ordered)), [f"rank {t.rank}\n{t.address}" for t in ordered])
    ax.set_ylim(len(ordered) - 0.5, -0.5)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    handles = [Patch(color=_COLOURS[name], label=name) for name in EVENT_NAMES]
    handles.append(Patch(color=_GAP_COLOUR, label=BETWEEN_RUNS))
    figure.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.02 / height_in),
        ncols=len(handles),
        frameon=False,
    )
    shown = runs_label(ordered)
    ax.set_title(f"{title}: {shown}" if title else shown, loc="left", pad=22)
    return figure


def plot_timeline(
    timelines: Sequence[StageTimeline], path: str | os.PathLike[str], *, title: str = ""
) -> None:
    """Draws one row per rank (rank 0 on top) against time in ms and saves it as a PNG.

    Forward and backward bars are coloured apart and carry the micro-batch number where it
    fits; waits are light grey, sends a thin dark strip. Gaps inside a run are the pipeline
    bubble; gaps between runs are shaded and labelled as the coordinator's time between
    steps. Uses an Agg canvas directly, without pyplot, so the caller's backend and figures
    are untouched.

    Raises:
        InvalidArgumentError: If two timelines share a rank.
    """
    figure = timeline_figure(timelines, title=title)
    figure.savefig(path, format="png")
    figure.clear()  # no pyplot manager holds it; dropping the artists frees it now


_GAP_COLOUR = "#fbe7a1"


def _draw_runs(ax: Axes, spans: Sequence[RunSpan], x0: int, num_rows: int, char_ms: float) -> None:
    """Labels each run above the rows and shades the gaps between consecutive runs."""
    top = -0.5
    for span in spans:
        start, end = (span.start_ns - x0) / 1e6, (span.end_ns - x0) / 1e6
        text = f"step {span.step}" if span.step else "inference"
        if end - start >= (len(text) + 1) * char_ms:
            ax.text((start + end) / 2, top, text, ha="center", va="bottom", size=8)
    for before, after in itertools.pairwise(spans):
        start, end = (before.end_ns - x0) / 1e6, (after.start_ns - x0) / 1e6
        if end <= start:
            continue
        ax.axvspan(start, end, color=_GAP_COLOUR, zorder=0)
        label = "between steps"
        if end - start >= (len(label) + 1) * char_ms:
            ax.text((start + end) / 2, num_rows / 2 - 0.5, label, ha="center", va="center", size=7)


def _draw_row(ax: Axes, row: int, events: Sequence[TraceEvent], x0: int, char_ms: float) -> None:
    """Draws one rank's bars: waits behind, compute on top, sends as a strip at the bottom."""
    for name, height, offset, zorder in (
        ("wait", 0.8, 0.0, 1),
        ("forward", 0.8, 0.0, 2),
        ("backward", 0.8, 0.0, 2),
        ("send", 0.15, 0.325, 3),
    ):
        chosen = [e for e in events if e.name == name]
        bars = [((e.start_ns - x0) / 1e6, (e.end_ns - e.start_ns) / 1e6) for e in chosen]
        if not bars:
            continue
        y = (row + offset - height / 2, height)
        ax.broken_barh(
            bars, y, facecolors=_COLOURS[name], edgecolor="white", linewidth=0.5, zorder=zorder
        )
        if name not in _COMPUTE:
            continue
        for e, (start, dur) in zip(chosen, bars, strict=True):
            text = str(e.microbatch)
            if dur >= (len(text) + 0.8) * char_ms:
                x = start + dur / 2
                ax.text(x, row, text, ha="center", va="center", size=7, color="w", zorder=4)


def _merged_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Returns the total length of the union of half-open ``[start, end)`` intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def busy_idle(
    timelines: Sequence[StageTimeline], *, step: int | None = None
) -> dict[int, tuple[float, float]]:
    """Returns ``{rank: (busy_s, idle_s)}`` over the span of the selected events.

    The span runs from the earliest start to the latest end of the selected events (every
    run, or only the runs of ``step``) across all ranks, so a stage that starts late or ends
    early is idle meanwhile. Busy is the union of that rank's forward and backward intervals;
    waits and sends count as idle. With no selected events every rank gets ``(0.0, 0.0)``.

    Raises:
        InvalidArgumentError: If two timelines share a rank.
    """
    ordered = _checked(timelines)
    chosen = {t.rank: [e for e in t.events if step is None or e.step == step] for t in ordered}
    everything = [e for events in chosen.values() for e in events]
    if not everything:
        return {rank: (0.0, 0.0) for rank in chosen}
    span_ns = max(e.end_ns for e in everything) - min(e.start_ns for e in everything)
    result: dict[int, tuple[float, float]] = {}
    for rank, events in chosen.items():
        busy_ns = _merged_ns((e.start_ns, e.end_ns) for e in events if e.name in _COMPUTE)
        result[rank] = (busy_ns / 1e9, (span_ns - busy_ns) / 1e9)
    return result


def ideal_bubble(num_stages: int, num_microbatches: int) -> float:
    """Returns the ideal bubble fraction ``(p - 1) / (m + p - 1)`` of GPipe and 1F1B.

    Raises:
        InvalidArgumentError: If either count is below 1.
    """
    if num_stages < 1 or num_microbatches < 1:
        raise InvalidArgumentError(
            f"num_stages ({num_stages}) and num_microbatches ({num_microbatches}) "
            "must be at least 1"
        )
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def order_of(timeline: StageTimeline, run_id: int) -> list[str]:
    """Returns the compute events of one run on one stage in start order: ``["F0", "B0"]``.

    The spelling is ``str(pipesvc.core.schedule.Action)``; an unknown ``run_id`` gives ``[]``.
    """
    compute = [e for e in timeline.events if e.run_id == run_id and e.name in _COMPUTE]
    compute.sort(key=lambda e: (e.start_ns, e.end_ns))
    return [_label(e) for e in compute]


def write_trace_files(
    timelines: Sequence[StageTimeline], stem: str | os.PathLike[str], *, title: str = ""
) -> tuple[Path, Path]:
    """Writes ``stem + ".json"`` (Chrome trace) and ``stem + ".png"`` (timeline, titled
    ``title`` or the stem's name, then the steps shown).

    Returns:
        The JSON path and the PNG path.

    Raises:
        InvalidArgumentError: If two timelines share a rank.
    """
    base = os.fspath(stem)
    json_path, png_path = Path(base + ".json"), Path(base + ".png")
    write_chrome_trace(timelines, json_path)
    plot_timeline(timelines, png_path, title=title or Path(base).name)
    return json_path, png_path
