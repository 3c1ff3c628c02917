"""Watching a cluster: Prometheus metrics that move, traces in the schedule's order, JSON logs."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import pipesvc
from pipesvc.core.schedule import stage_actions
from pipesvc.observe.trace import StageTimeline, TraceEvent, busy_idle, order_of
from tests.support.faults import free_port
from tests.support.processes import run_coordinator_briefly
from tests.support.reference import PROBLEMS

MLP = PROBLEMS["mlp"]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(pipesvc_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    assert "process_resident_memory_bytes" in text  # process metrics come along
    return values


def test_metrics_move_during_training() -> None:
    coordinator_port, stage_port = free_port(), free_port()
    with (
        pipesvc.LocalCluster(
            num_stages=1,
            threads_per_stage=1,
            coordinator_args=["--metrics-port", str(coordinator_port)],
        ) as cluster,
        cluster.connect() as client,
    ):
        cluster.add_stage(["--metrics-port", str(stage_port)])
        with client.create_job(
            model="mlp", model_args=MLP.model_args, num_stages=2, num_microbatches=4, loss="mse"
        ) as job:
            x, y = MLP.batch(8, seed=0)
            job.train_step(x, y)
            before = (_scrape(coordinator_port), _scrape(stage_port))
            for _ in range(3):
                job.train_step(x, y)
            after = (_scrape(coordinator_port), _scrape(stage_port))
            job.train_step(x, y)  # a successor for the gauged run, to bound when it ended
            [timeline] = [t for t in job.timelines(max_runs=3) if t.rank == 1]
    coordinator = {k: after[0][k] - before[0].get(k, 0.0) for k in after[0]}
    stage = {k: after[1][k] - before[1].get(k, 0.0) for k in after[1]}
    assert coordinator["pipesvc_steps_committed_total"] == 3
    assert coordinator["pipesvc_step_seconds_count"] == 3
    # The second stage (rank 1) receives 4 activations and sends 4 gradients per step.
    received = 'pipesvc_frames_total{direction="received",kind="activation"}'
    sent = 'pipesvc_bytes_total{direction="sent",kind="gradient"}'
    assert stage[received] == 12
    # Each gradient is a float32 (micro-batch of 2, hidden width) tensor: 8 samples per step.
    assert stage[sent] == 3 * 8 * MLP.model_args["hidden_features"] * 4
    assert stage['pipesvc_action_seconds_count{action="forward"}'] == 12
    assert stage['pipesvc_action_seconds_count{action="backward"}'] == 12
    assert stage['pipesvc_runs_total{mode="train"}'] == 3
    _check_bubble_gauge(after[1]["pipesvc_bubble_fraction"], timeline.events)


def _check_bubble_gauge(gauge: float, events: tuple[TraceEvent, ...]) -> None:
    """The gauge is ``1 - busy / window`` of the stage's last training run (the middle of the
    three runs in ``events``). Busy is the run's forward and backward time, which the trace
    holds to the nanosecond; the window is unknown but lies between the run's own first and
    last event and the end of the run before and the start of the run after (one thread
    runs them in turn). So the gauge has exact bounds, whatever the timing."""
    before, gauged, after = (
        [e for e in events if e.run_id == run] for run in sorted({e.run_id for e in events})
    )
    busy_ns = sum(e.end_ns - e.start_ns for e in gauged if e.name in ("forward", "backward"))
    narrowest_ns = max(e.end_ns for e in gauged) - min(e.start_ns for e in gauged)
    widest_ns = min(e.start_ns for e in after) - max(e.end_ns for e in before)
    assert 1 - busy_ns / narrowest_ns - 1e-9 <= gauge <= 1 - busy_ns / widest_ns + 1e-9, (
        f"gauge {gauge}; busy {busy_ns} ns in a run of {narrowest_ns} to {widest_ns} ns"
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_trace_follows_the_schedule(client: pipesvc.Client, schedule: str, tmp_path: Path) -> None:
    with client.create_job(
        model="mlp",
        model_args=MLP.model_args,
        num_stages=3,
        num_microbatches=4,
        schedule=schedule,
        loss="mse",
    ) as job:
        x, y = MLP.batch(8, seed=0)
        job.train_step(x, y)
        job.train_step(x, y)
        timelines = job.timelines(max_runs=1)
        assert [t.rank for t in timelines] == [0, 1, 2]
        for timeline in timelines:
            run_id = max(e.run_id for e in timeline.events)
            expected = stage_actions(schedule, rank=timeline.rank, num_stages=3, num_microbatches=4)
            assert order_of(timeline, run_id) == [str(a) for a in expected]
        _check_timeline_structure(timelines)
        json_path, png_path = job.trace(tmp_path / "trace")
    trace = json.loads(json_path.read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    for mb in range(4):  # the newest 5 runs: 2 training steps on 3 stages
        assert names.count(f"F{mb}") == 2 * 3
        assert names.count(f"B{mb}") == 2 * 3
    assert png_path.read_bytes().startswith(b"\x89PNG")


def _check_timeline_structure(timelines: list[StageTimeline]) -> None:
    """One run on every rank: each rank's events follow one another without overlap (one
    thread runs them), each compute starts after the neighbour's compute it needs has ended
    (one host, one clock), and busy_idle's figures equal busy and idle summed by hand."""
    assert len({e.run_id for t in timelines for e in t.events}) == 1
    [step] = {e.step for t in timelines for e in t.events}
    ends: dict[tuple[int, str], int] = {}
    for t in timelines:
        ordered = sorted(t.events, key=lambda e: (e.start_ns, e.end_ns))
        for earlier, later in itertools.pairwise(ordered):
            assert earlier.end_ns <= later.start_ns, f"rank {t.rank}: {earlier} overlaps {later}"
        for e in ordered:
            if e.name in ("forward", "backward"):
                ends[(t.rank, f"{e.name[0].upper()}{e.microbatch}")] = e.end_ns
    for t in timelines:
        for e in t.events:
            needs = {"forward": t.rank - 1, "backward": t.rank + 1}.get(e.name)
            key = (needs, f"{e.name[0].upper()}{e.microbatch}") if needs is not None else None
            if key in ends:
                assert e.start_ns >= ends[key], f"rank {t.rank} ran {key[1]} before rank {needs}"
    window_ns = max(e.end_ns for t in timelines for e in t.events) - min(
        e.start_ns for t in timelines for e in t.events
    )
    figures = busy_idle(timelines, step=step)
    for t in timelines:
        busy_ns = sum(e.end_ns - e.start_ns for e in t.events if e.name in ("forward", "backward"))
        assert figures[t.rank] == pytest.approx(
            (busy_ns / 1e9, (window_ns - busy_ns) / 1e9), rel=1e-9, abs=1e-12
        )


def test_trace_command_and_status_columns(cluster: pipesvc.LocalCluster, tmp_path: Path) -> None:
    with (
        cluster.connect() as client,
        client.create_job(model="mlp", model_args=MLP.model_args, num_stages=2, loss="mse") as job,
    ):
        x, y = MLP.batch(8, seed=0)
        job.train_step(x, y)
        out = tmp_path / "cli-trace"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipesvc",
                "trace",
                "--coordinator",
                cluster.address,
                "--job",
                job.id,
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert out.with_suffix(".json").exists() and out.with_suffix(".png").exists()
        status = subprocess.run(
            [sys.executable, "-m", "pipesvc", "status", "--coordinator", cluster.address],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0
        assert "MICROBATCH/S" in status.stdout and "RSS" in status.stdout
        busy = [line for line in status.stdout.splitlines() if job.id in line]
        assert len(busy) == 2
        assert all(re.search(r"\d+ MiB", line) for line in busy)


def test_json_logs_are_one_object_per_line(tmp_path: Path) -> None:
    returncode, stderr = run_coordinator_briefly(tmp_path, "127.0.0.1:0", ("--log-format", "json"))
    assert returncode == 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines
    for line in lines:
        entry = json.loads(line)
        assert {"time", "level", "logger", "message", "pid"} <= entry.keys()
    assert any("coordinator listening" in json.loads(line)["message"] for line in lines)
