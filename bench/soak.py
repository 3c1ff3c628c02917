"""Soak: one job trained for a set time, with speed and each process's resources every minute.

Models (each on a fresh ``LocalCluster(num_stages=2, threads_per_stage=1)``, 1F1B, SGD
(lr 1e-3), uniform split, checkpoints at the default interval, every 10 steps):

- gpt: the built-in ``gpt`` as in ``bench/pipeline.py`` (vocabulary 128, sequence length
  128, embedding 128, 4 heads, 6 blocks), batch 16 x 128 tokens in 8 micro-batches,
  cross-entropy.
- mlp: the built-in ``mlp`` with its defaults (16 -> 32 x 3 -> 8), batch 64 in 4 micro-batches,
  MSE (as in ``bench/overhead.py``).

Each model trains for ``--minutes`` (default 10) after 3 warm-up steps, the same batch every
step, each step a ``train_step`` call (with ``--train``: one ``job.train`` stream of them all,
the step time taken from one loss to the next). Every minute (every ``--interval-s``) a row
shows that interval's steps/s and p50 and p99 of the step time seen by the client, and, for the
coordinator, each stage (``LocalCluster.pids``) and the client (this process), the resident
memory (``VmRSS``), open file descriptors
(``/proc/<pid>/fd``) and threads (``Threads`` in ``/proc/<pid>/status``), and the number of
files and bytes under the coordinator's state directory (database, checkpoints, step log).
Row 0 is taken after the warm-up. A last table shows each figure after the warm-up,
after the first minute and at the end: growth that goes on after the first minute is a leak.

Usage: ``python bench/soak.py [--minutes 10] [--models gpt,mlp] [--train]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pipesvc  # noqa: E402
from bench import overhead, pipeline  # noqa: E402

NUM_STAGES, LR, WARMUP_STEPS = 2, 1e-3, 3
MiB = 1 << 20


@dataclass(frozen=True)
class Soak:
    """A model as the soak trains it."""

    workload: pipeline.Workload
    num_microbatches: int
    batch: tuple[torch.Tensor, torch.Tensor]


SOAKS = {
    "gpt": Soak(pipeline.GPT, pipeline.NUM_MICROBATCHES, pipeline._batch(pipeline.GPT)),
    "mlp": Soak(overhead.MLP, overhead.NUM_MICROBATCHES, overhead._batch(overhead.MLP)),
}


@dataclass(frozen=True)
class Resources:
    """One process's resources at one moment."""

    rss_bytes: int
    num_fds: int
    num_threads: int

    def cell(self) -> str:
        return f"{self.rss_bytes / MiB:.0f}/{self.num_fds}/{self.num_threads}"


def resources(pid: int) -> Resources:
    """RSS, open fds and threads of a live process, from ``/proc``."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    rss_bytes = int(status["VmRSS"].split()[0]) * 1024  # "  123456 kB"
    num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Resources(rss_bytes, num_fds, int(status["Threads"]))


def tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under ``root``; files that vanish while counting are skipped."""
    files = num_bytes = 0
    for directory, _, names in os.walk(root):
        for name in names:
            try:
                num_bytes += os.stat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                continue
            files += 1
    return files, num_bytes


def _row(
    label: str, step_ms: list[float], seconds: float, pids: list[int], state: Path
) -> list[str]:
    files, num_bytes = tree_size(state)
    rate = len(step_ms) / seconds if seconds > 0 else 0.0
    cells = [label, str(len(step_ms)), f"{rate:.2f}"]
    cells += [
        f"{overhead.percentile(step_ms, 0.5):.1f}",
        f"{overhead.percentile(step_ms, 0.99):.1f}",
    ]
    cells += [resources(pid).cell() for pid in pids]
    return [*cells, str(files), f"{num_bytes / MiB:.2f}"]


def soak(name: str, minutes: float, interval_s: float, train: bool) -> list[list[str]]:
    """Trains ``name`` for ``minutes`` (``train``: through one ``job.train`` stream); returns
    the table's rows (header first)."""
    s = SOAKS[name]
    w = s.workload
    header = ["minute", "steps", "steps/s", "p50 ms", "p99 ms", "coordinator"]
    header += [f"stage {r}" for r in range(NUM_STAGES)] + ["client", "state files", "state MiB"]
    rows = [header]
    with pipesvc.LocalCluster(
        num_stages=NUM_STAGES, models=["bench.bench_models"], threads_per_stage=1
    ) as cluster:
        state = cluster.log_dir / "state"
        client = cluster.connect()
        job = client.create_job(
            model=w.model,
            model_args=w.model_args,
            num_stages=NUM_STAGES,
            num_microbatches=s.num_microbatches,
            schedule="1f1b",
            optimizer={"name": "sgd", "lr": LR},
            loss=w.loss,
            partition="uniform",
        )
        for _ in range(WARMUP_STEPS):
            job.train_step(*s.batch)
        pids = [*cluster.pids, os.getpid()]
        stream = job.train(itertools.repeat(s.batch)) if train else None
        if stream is not None:
            next(stream)
        rows.append(_row("0", [], 0.0, pids, state))
        end = time.monotonic() + minutes * 60
        interval = 0
        while time.monotonic() < end:
            interval += 1
            started = time.monotonic()
            stop = min(end, started + interval_s)
            step_ms: list[float] = []
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                if stream is not None:
                    next(stream)
                else:
                    job.train_step(*s.batch)
                step_ms.append((time.perf_counter() - t0) * 1e3)
            label = f"{interval * interval_s / 60:.2f}".rstrip("0").rstrip(".")
            rows.append(_row(label, step_ms, time.monotonic() - started, pids, state))
            print("  ".join(rows[-1]), flush=True)
        if stream is not None:
            stream.close()  # the steps already sent finish first
        job.close()
        client.close()
    return rows


def _growth(rows: list[list[str]]) -> list[list[str]]:
    """The resource columns after the warm-up, after the first interval and at the end."""
    picked = [rows[i] for i in sorted({1, min(2, len(rows) - 1), len(rows) - 1})]
    out = [["", *(f"minute {row[0]}" for row in picked)]]
    for column in range(5, len(rows[0])):
        out.append([rows[0][column], *(row[column] for row in picked)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training time per model")
    parser.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp")
    parser.add_argument("--interval-s", type=float, default=60.0, help="seconds per row")
    parser.add_argument(
        "--train", action="store_true", help="stream the steps through job.train, not train_step"
    )
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # for the stage processes, which import bench.bench_models
    for name in args.models.split(","):
        print(f"\n{name}: training for {args.minutes:g} min", flush=True)
        rows = soak(name, args.minutes, args.interval_s, args.train)
        s = SOAKS[name]
        print(
            f"\n{name}: {s.workload.model} {s.workload.model_args}, batch "
            f"{len(s.batch[0])} in {s.num_microbatches} micro-batches, {NUM_STAGES} stages, "
            f"1F1B, SGD, checkpoint every 10 steps; {os.cpu_count()} CPU cores, load average "
            f"{os.getloadavg()[0]:.1f}.\nProcess cells: RSS MiB / open fds / threads.\n"
        )
        pipeline._print_table(rows)
        print()
        pipeline._print_table(_growth(rows))


if __name__ == "__main__":
    main()
