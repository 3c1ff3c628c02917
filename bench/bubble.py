"""Pipeline bubble: each stage's busy and idle time per training step, from its own timestamps.

Model and job as ``bench/pipeline.py``'s mlp rows: 8 x (Linear(1024, 1024) + ReLU)
(``bench-mlp``), batch 64 in m = 8 micro-batches, MSE, SGD (lr 1e-3), split uniformly over
p = 2 or 4 stages, ``LocalCluster(num_stages=p, threads_per_stage=1)`` (a coordinator plus p
stage processes), checkpoints off, GPipe, 1F1B, zb-h1 and interleaved-1f1b with 2 layer
ranges per stage (``virtual_stages=2``: 2p ranges of 8 / 2p layers). 3 warm-up steps, then 20
timed steps (5 with ``--quick``), each timed from the client; then ``job.timelines()`` fetches
what the stages recorded.

How busy and idle are defined:

- Every stage timestamps each action of a run with ``time.time_ns()`` (one host, so one
  clock): ``forward``, ``backward`` and (zb-h1) ``weight`` of a micro-batch (compute; the
  last stage's forward includes its loss), ``wait`` (blocked on an activation or a gradient
  from a neighbour) and ``send`` (handing a tensor to the link that streams it to the
  neighbour).
- The **step window** runs from the earliest start to the latest end of any event of that
  step on any stage (``pipesvc.observe.trace.busy_idle(timelines, step=s)``). It holds the stages'
  schedules only: the client's request, the coordinator's dispatch and the batch transfer
  before the first event, and the commit (optimizer step) after the last one, are outside it.
  ``client ms/step`` is the whole step as the client sees it, for comparison.
- A stage's **busy** time is the length of the union of its forward and backward intervals
  in the window; its **idle** time is the rest of the window. The second table splits idle
  into the stage's ``wait`` and ``send`` events, ``gaps`` (untracked time between its own
  first and last event: the Python between one action and the next) and ``outside`` (the
  part of the window before its first or after its last event: the last stages finish
  their backwards first and sit out the drain while the earlier ones finish theirs, and a
  stage that gets the step's request late starts late).
- A stage's **idle fraction** is its idle time summed over the timed steps divided by their
  windows summed; ``mean idle`` and ``max idle`` are over the stages.
- The **ideal bubble** (``pipesvc.core.schedule.ideal_bubble``) is the idle share of the
  schedule's dry run with every action one tick: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B
  (the idle fraction of every stage when each stage's forward and backward of a micro-batch
  take the same time on every stage and communication is free: window
  ``(m + p - 1)(t_f + t_b)``, busy ``m (t_f + t_b)``), ``(p - 1) / (3m + p - 1)`` for zb-h1
  (its input-gradient and weight-gradient passes each as long as the forward),
  ``(p - 1) / (V m + p - 1)`` for interleaved-1f1b (each chunk's passes a V-th of the
  stage's).
  ``mean/ideal`` is mean idle over it.

On 2 cores, 4 stages (5 processes, each with gRPC threads) oversubscribe the CPU: a stage
that is descheduled in the middle of a forward still counts as busy, so contention stretches
busy time and the idle fraction mixes the schedule's bubble with waiting for a core.

Usage: ``python bench/bubble.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import pipesvc
from pipesvc.core.schedule import ideal_bubble as schedule_bubble
from pipesvc.observe.trace import StageTimeline, busy_idle

REPO_ROOT = Path(__file__).resolve().parents[1]
WIDTH, DEPTH, BATCH, NUM_MICROBATCHES, LR = 1024, 8, 64, 8, 1e-3
WARMUP_STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
VIRTUAL_STAGES = {"interleaved-1f1b": 2}
"""Layer ranges per stage of the schedules that interleave (the rest hold one)."""
STAGE_COUNTS = (2, 4)


@dataclass(frozen=True)
class Bubble:
    """Per-step means of one job's timed steps; per-stage lists are indexed by rank."""

    client_ms: float
    window_ms: float
    busy_ms: list[float]
    wait_ms: list[float]
    send_ms: list[float]
    active_ms: list[float]
    """From the stage's first event of the step to its last."""
    idle_fraction: list[float]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def analyse(timelines: list[StageTimeline], steps: range, client_s: float) -> Bubble:
    """Busy and idle time of each stage over ``steps`` (see the module docstring)."""
    ranks = sorted(t.rank for t in timelines)
    window_ns = 0.0
    busy_ns = dict.fromkeys(ranks, 0.0)
    other_ns = {name: dict.fromkeys(ranks, 0.0) for name in ("wait", "send", "active")}
    for step in steps:
        runs = {e.run_id for t in timelines for e in t.events if e.step == step}
        if len(runs) != 1:  # e.g. a retried step: busy_idle(step=) would merge the runs
            raise RuntimeError(f"step {step} has {len(runs)} runs in the trace: {sorted(runs)}")
        for t in timelines:
            events = [e for e in t.events if e.step == step]
            if not events:
                raise RuntimeError(f"rank {t.rank} recorded nothing for step {step}")
            for e in events:  # one thread runs a stage's actions: they never overlap
                if e.name in other_ns:
                    other_ns[e.name][t.rank] += e.end_ns - e.start_ns
            active = max(e.end_ns for e in events) - min(e.start_ns for e in events)
            other_ns["active"][t.rank] += active
        per_rank = busy_idle(timelines, step=step)
        for rank, (busy_s, _) in per_rank.items():
            busy_ns[rank] += busy_s * 1e9
        window_ns += sum(per_rank[ranks[0]]) * 1e9
    n = len(steps)
    return Bubble(
        client_ms=client_s * 1e3 / n,
        window_ms=window_ns / 1e6 / n,
        busy_ms=[busy_ns[r] / 1e6 / n for r in ranks],
        wait_ms=[other_ns["wait"][r] / 1e6 / n for r in ranks],
        send_ms=[other_ns["send"][r] / 1e6 / n for r in ranks],
        active_ms=[other_ns["active"][r] / 1e6 / n for r in ranks],
        idle_fraction=[1.0 - busy_ns[r] / window_ns for r in ranks],
    )


def measure(num_stages: int, num_steps: int) -> dict[str, Bubble]:
    """Runs each schedule on one fresh local cluster of ``num_stages`` stages."""
    x, y = _batch()
    results = {}
    with pipesvc.LocalCluster(
        num_stages=num_stages, models=["bench.bench_models"], threads_per_stage=1
    ) as cluster:
        client = cluster.connect()
        for schedule in SCHEDULES:
            job = client.create_job(
                model="bench-mlp",
                model_args={"width": WIDTH, "depth": DEPTH},
                num_stages=num_stages,
                virtual_stages=VIRTUAL_STAGES.get(schedule, 1),
                num_microbatches=NUM_MICROBATCHES,
                schedule=schedule,
                optimizer={"name": "sgd", "lr": LR},
                loss="mse",
                partition="uniform",
                checkpoint_every=0,
            )
            for _ in range(WARMUP_STEPS):
                job.train_step(x, y)
            first = job.step + 1
            start = time.perf_counter()
            for _ in range(num_steps):
                job.train_step(x, y)
            client_s = time.perf_counter() - start
            steps = range(first, job.step + 1)
            results[schedule] = analyse(job.timelines(), steps, client_s)
            job.close()
        client.close()
    return results


def _cells(values: list[float], spec: str) -> str:
    return " / ".join(format(v, spec) for v in values)


def _print_markdown(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [[cell.ljust(w) for cell, w in zip(row, widths, strict=True)] for row in rows]
    lines.insert(1, ["-" * w for w in widths])
    for line in lines:
        print(f"| {' | '.join(line)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 timed steps instead of 20")
    args = parser.parse_args()
    num_steps = 5 if args.quick else 20
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # for the stage processes, which import bench.bench_models
    sys.path.insert(0, str(REPO_ROOT))
    results = {(p, s): b for p in STAGE_COUNTS for s, b in measure(p, num_steps).items()}
    summary = [
        [
            "schedule",
            "stages",
            "client ms/step",
            "window ms/step",
            "busy ms/step by rank",
            "idle fraction by rank",
            "mean idle",
            "max idle",
            "ideal bubble",
            "mean/ideal",
        ]
    ]
    breakdown = [["schedule", "stages", "rank", "busy", "wait", "send", "gaps", "outside"]]
    for (num_stages, schedule), b in results.items():
        ideal = schedule_bubble(
            schedule,
            num_stages=num_stages,
            num_microbatches=NUM_MICROBATCHES,
            virtual_stages=VIRTUAL_STAGES.get(schedule, 1),
        )
        mean_idle = sum(b.idle_fraction) / num_stages
        summary.append(
            [
                schedule,
                str(num_stages),
                f"{b.client_ms:.1f}",
                f"{b.window_ms:.1f}",
                _cells(b.busy_ms, ".1f"),
                _cells(b.idle_fraction, ".2f"),
                f"{mean_idle:.2f}",
                f"{max(b.idle_fraction):.2f}",
                f"{ideal:.2f}",
                f"{mean_idle / ideal:.2f}",
            ]
        )
        for rank in range(num_stages):
            busy, wait, send = b.busy_ms[rank], b.wait_ms[rank], b.send_ms[rank]
            gaps = b.active_ms[rank] - busy - wait - send
            outside = b.window_ms - b.active_ms[rank]
            cells = (f"{v:.1f}" for v in (busy, wait, send, gaps, outside))
            breakdown.append([schedule, str(num_stages), str(rank), *cells])
    print(
        f"\nBusy and idle per training step from the stages' own timestamps, {DEPTH} x "
        f"(Linear({WIDTH}, {WIDTH}) + ReLU), batch {BATCH} in {NUM_MICROBATCHES} "
        f"micro-batches, MSE, SGD;\n{WARMUP_STEPS} warm-up + {num_steps} timed steps; 1 thread "
        f"per stage process (plus a coordinator process); {os.cpu_count()} CPU cores.\n"
    )
    _print_markdown(summary)
    print("\nPer stage, ms/step (window = busy + wait + send + gaps + outside):\n")
    _print_markdown(breakdown)


if __name__ == "__main__":
    main()
