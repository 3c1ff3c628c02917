"""Unit tests for the step trace: Chrome trace JSON, PNG timeline, busy/idle and run order."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pipesvc.core.schedule import Action, ActionKind, stage_actions
from pipesvc.core.schedule_sim import bubble_fraction, simulate
from pipesvc.errors import InvalidArgumentError
from pipesvc.observe.trace import (
    BETWEEN_RUNS,
    StageTimeline,
    TraceEvent,
    busy_idle,
    chrome_trace,
    ideal_bubble,
    order_of,
    plot_timeline,
    run_spans,
    runs_label,
    timeline_figure,
    write_chrome_trace,
    write_trace_files,
)

ROOT = Path(__file__).resolve().parents[2]
BASE_NS = 1_760_000_000_000_000_000  # a realistic time.time_ns() value
TICK_NS = 1_000_000  # one simulator tick is 1 ms
NUM_STAGES, NUM_MICROBATCHES = 3, 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plan(schedule: str) -> list[list[Action]]:
    return [
        stage_actions(schedule, rank=r, num_stages=NUM_STAGES, num_microbatches=NUM_MICROBATCHES)
        for r in range(NUM_STAGES)
    ]


def event(
    name: str, microbatch: int, start_ns: int, end_ns: int, *, run_id: int = 0, step: int = 0
) -> TraceEvent:
    return TraceEvent(
        run_id=run_id,
        step=step,
        name=name,
        microbatch=microbatch,
        start_ns=start_ns,
        end_ns=end_ns,
    )


def timelines_from_grid(
    grid: list[list[Action | None]], *, run_id: int = 0, step: int = 0, offset_ns: int = 0
) -> list[StageTimeline]:
    """One timeline per grid row: compute per tick, a wait per idle tick, a send per forward."""
    timelines = []
    for rank, row in enumerate(grid):
        events = []
        for tick, slot in enumerate(row):
            start = BASE_NS + offset_ns + tick * TICK_NS
            if slot is None:
                events.append(event("wait", 0, start, start + TICK_NS, run_id=run_id, step=step))
                continue
            name = "forward" if slot.kind is ActionKind.FORWARD else "backward"
            mb = slot.microbatch_index
            events.append(event(name, mb, start, start + TICK_NS, run_id=run_id, step=step))
            if name == "forward" and rank < len(grid) - 1:
                send_start = start + TICK_NS * 9 // 10
                events.append(
                    event("send", mb, send_start, start + TICK_NS, run_id=run_id, step=step)
                )
        # Shuffle-ish: the module must not rely on recording order.
        timelines.append(
            StageTimeline(rank=rank, address=f"127.0.0.1:{5000 + rank}", events=tuple(events[::-1]))
        )
    return timelines


@pytest.fixture(params=["gpipe", "1f1b"])
def schedule(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_chrome_trace_has_one_forward_and_backward_per_microbatch_per_stage(
    schedule: str,
) -> None:
    trace = chrome_trace(timelines_from_grid(simulate(plan(schedule))))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    assert isinstance(events, list)
    spans = [e for e in events if e["ph"] == "X"]
    compute = Counter((e["pid"], e["name"]) for e in spans if e["cat"] in ("forward", "backward"))
    expected = {
        (rank, f"{kind}{mb}"): 1
        for rank in range(NUM_STAGES)
        for kind in "FB"
        for mb in range(NUM_MICROBATCHES)
    }
    assert compute == expected
    for span in spans:
        assert span["tid"] == (0 if span["cat"] in ("forward", "backward") else 1)
        assert span["ts"] >= 0 and span["dur"] >= 0
        assert set(span["args"]) == {"run_id", "step", "microbatch"}
        if span["cat"] in ("wait", "send"):
            assert span["name"] == f"{span['cat']} {span['args']['microbatch']}"
    assert min(span["ts"] for span in spans) == 0
    first_forward = next(s for s in spans if s["pid"] == 1 and s["name"] == "F0")
    assert first_forward["ts"] == 1000.0 and first_forward["dur"] == 1000.0  # 1 ms in us


def test_chrome_trace_names_each_process_and_round_trips_json(tmp_path: Path) -> None:
    timelines = timelines_from_grid(simulate(plan("1f1b")))
    trace = chrome_trace(timelines)
    assert json.loads(json.dumps(trace)) == trace
    events = trace["traceEvents"]
    assert isinstance(events, list)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r} (127.0.0.1:{5000 + r})" for r in range(NUM_STAGES)}
    assert all(e["ph"] == "M" for e in events if e["name"] == "process_name")
    path = tmp_path / "trace.json"
    write_chrome_trace(timelines, path)
    assert json.loads(path.read_text(encoding="utf-8")) == trace


def test_chrome_trace_of_nothing_is_empty_and_repeated_ranks_are_rejected() -> None:
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}
    twice = [
        StageTimeline(rank=1, address="a", events=()),
        StageTimeline(rank=1, address="b", events=()),
    ]
    with pytest.raises(InvalidArgumentError, match="repeat a rank"):
        chrome_trace(twice)


def test_order_of_matches_the_schedule(schedule: str) -> None:
    actions = plan(schedule)
    first = timelines_from_grid(simulate(actions), run_id=7, step=1)
    second = timelines_from_grid(simulate(actions), run_id=8, step=2, offset_ns=100 * TICK_NS)
    for rank in range(NUM_STAGES):
        both = StageTimeline(
            rank=rank, address="x", events=first[rank].events + second[rank].events
        )
        expected = [str(action) for action in actions[rank]]
        assert order_of(both, 7) == expected
        assert order_of(both, 8) == expected
        assert order_of(both, 9) == []


def test_busy_idle_matches_the_grid_bubble(schedule: str) -> None:
    grid = simulate(plan(schedule))
    result = busy_idle(timelines_from_grid(grid))
    assert sorted(result) == list(range(NUM_STAGES))
    for rank, row in enumerate(grid):
        busy_s, idle_s = result[rank]
        assert busy_s == pytest.approx(sum(slot is not None for slot in row) * TICK_NS / 1e9)
        assert idle_s == pytest.approx(bubble_fraction([row]) * len(row) * TICK_NS / 1e9)
    total_idle = sum(idle for _, idle in result.values())
    total = sum(busy + idle for busy, idle in result.values())
    assert total_idle / total == pytest.approx(bubble_fraction(grid))
    if schedule == "gpipe":
        assert bubble_fraction(grid) == pytest.approx(ideal_bubble(NUM_STAGES, NUM_MICROBATCHES))


def test_busy_idle_selects_a_step_and_counts_overlaps_once() -> None:
    grid = simulate(plan("gpipe"))
    gap_ns = 1000 * TICK_NS
    timelines = [
        StageTimeline(rank=a.rank, address=a.address, events=a.events + b.events)
        for a, b in zip(
            timelines_from_grid(grid, run_id=1, step=1),
            timelines_from_grid(grid, run_id=2, step=2, offset_ns=gap_ns),
            strict=True,
        )
    ]
    one_step = busy_idle(timelines, step=2)
    assert one_step == pytest.approx(busy_idle(timelines_from_grid(grid)))
    everything = busy_idle(timelines)
    assert everything[0][0] == pytest.approx(2 * one_step[0][0])
    assert sum(everything[0]) == pytest.approx((gap_ns + len(grid[0]) * TICK_NS) / 1e9)
    assert busy_idle(timelines, step=99) == {r: (0.0, 0.0) for r in range(NUM_STAGES)}
    overlapping = (
        event("forward", 0, 0, 4 * TICK_NS),
        event("backward", 0, 2 * TICK_NS, 6 * TICK_NS),
        event("forward", 1, 3 * TICK_NS, 5 * TICK_NS),
        event("wait", 0, 6 * TICK_NS, 10 * TICK_NS),
    )
    busy, idle = busy_idle([StageTimeline(rank=0, address="a", events=overlapping)])[0]
    assert (busy, idle) == pytest.approx((0.006, 0.004))


def test_ideal_bubble() -> None:
    assert ideal_bubble(1, 8) == 0.0
    assert ideal_bubble(3, 4) == pytest.approx(2 / 6)
    assert ideal_bubble(4, 1) == pytest.approx(3 / 4)
    with pytest.raises(InvalidArgumentError, match="num_stages"):
        ideal_bubble(0, 4)
    with pytest.raises(InvalidArgumentError, match="num_microbatches"):
        ideal_bubble(2, 0)


def test_bad_events_are_rejected() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"end_ns \(5\) is before start_ns \(9\)"
    ) as info:
        event("forward", 3, 9, 5, run_id=12)
    assert "run_id=12" in str(info.value) and "microbatch=3" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="name must be one of"):
        event("recv", 0, 0, 1)
    with pytest.raises(InvalidArgumentError, match="microbatch"):
        event("forward", -1, 0, 1)
    with pytest.raises(InvalidArgumentError, match="rank"):
        StageTimeline(rank=-1, address="a", events=())
    assert event("wait", 0, 5, 5).end_ns == 5  # zero-length events are fine


def test_plot_timeline_writes_a_png_and_keeps_the_backend(tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    path = tmp_path / "timeline.png"
    plot_timeline(timelines_from_grid(simulate(plan("1f1b"))), path, title="1F1B, 3 x 4")
    assert matplotlib.get_backend() == before
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000


def test_plot_timeline_leaves_pyplot_and_the_callers_backend_alone(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    script = (
        "import sys, matplotlib\n"
        "matplotlib.use('svg')\n"
        "import pipesvc.observe.trace as t\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "e = t.TraceEvent(run_id=0, step=0, name='forward', microbatch=0, start_ns=0, end_ns=10)\n"
        f"t.plot_timeline([t.StageTimeline(rank=0, address='a', events=(e,))], {str(tmp_path / 'p.png')!r})\n"  # noqa: E501
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)


def test_importing_trace_does_not_import_matplotlib_or_grpc() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, pipesvc.observe.trace; print(sorted(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = done.stdout
    assert "'matplotlib'" not in loaded
    source = (ROOT / "pipesvc" / "observe" / "trace.py").read_text(encoding="utf-8")
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name.split(".")[0].startswith("grpc")]


def test_write_trace_files_writes_both_next_to_the_stem(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    stem = tmp_path / "run.step3"
    json_path, png_path = write_trace_files(timelines_from_grid(simulate(plan("gpipe"))), stem)
    assert (json_path, png_path) == (tmp_path / "run.step3.json", tmp_path / "run.step3.png")
    assert json.loads(json_path.read_text(encoding="utf-8"))["displayTimeUnit"] == "ms"
    assert png_path.read_bytes().startswith(PNG_MAGIC)


def _two_steps_with_a_gap() -> list[StageTimeline]:
    grid = simulate(plan("1f1b"))
    first = timelines_from_grid(grid, run_id=3, step=3)
    second = timelines_from_grid(grid, run_id=4, step=4, offset_ns=50 * TICK_NS)
    return [
        StageTimeline(rank=a.rank, address=a.address, events=a.events + b.events)
        for a, b in zip(first, second, strict=True)
    ]


def test_runs_label_names_the_steps_shown() -> None:
    timelines = _two_steps_with_a_gap()
    assert runs_label(timelines) == "steps 3 to 4"
    spans = run_spans(timelines)
    assert [(s.run_id, s.step) for s in spans] == [(3, 3), (4, 4)]
    assert spans[0].end_ns < spans[1].start_ns
    inference = timelines_from_grid(simulate(plan("gpipe")), run_id=9, step=0)
    assert runs_label(inference) == "1 inference run"
    assert runs_label([]) == "no runs"


def test_timeline_png_has_a_title_with_schedule_and_steps_and_explains_gaps() -> None:
    pytest.importorskip("matplotlib")
    figure = timeline_figure(_two_steps_with_a_gap(), title="job j: mlp, 1f1b, 3 stages x 4")
    ax = figure.axes[0]
    assert ax.get_title(loc="left") == "job j: mlp, 1f1b, 3 stages x 4: steps 3 to 4"
    texts = [t.get_text() for t in ax.texts]
    assert "step 3" in texts and "step 4" in texts
    assert "between steps" in texts  # the shaded gap is labelled on the plot
    [legend] = figure.legends
    assert BETWEEN_RUNS in [t.get_text() for t in legend.get_texts()]
    figure.clear()


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_timeline_png_legend_covers_neither_the_title_nor_the_axis(stages: int) -> None:
    pytest.importorskip("matplotlib")
    # A title as long as the demo's, on figures of every height the demo and trace draw.
    title = "pipesvc-demo-trace: gpt, 1f1b, 4 stages x 8 micro-batches"
    timelines = [
        StageTimeline(rank=r, address=f"127.0.0.1:{5000 + r}", events=t.events)
        for r, t in zip(range(stages), _two_steps_with_a_gap() * stages, strict=False)
    ]
    figure = timeline_figure(timelines, title=title)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    [legend] = [*figure.legends, *[a.get_legend() for a in figure.axes if a.get_legend()]]
    ax = figure.axes[0]
    box = legend.get_window_extent(renderer)
    for other in (ax.title, ax._left_title, ax.xaxis.label):  # type: ignore[attr-defined]
        if other.get_text():
            assert not box.overlaps(other.get_window_extent(renderer)), other.get_text()
    assert not box.overlaps(ax.get_window_extent(renderer))
    fig_box = figure.bbox
    assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 and fig_box.y0 <= box.y0
    figure.clear()
