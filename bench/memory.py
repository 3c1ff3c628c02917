"""Peak resident memory of a 4-stage pipesvc cluster vs the same training in one process.

Model: ``depth`` x Linear(width, width) (default 48 x 2048: 201M parameters, 0.8 GB of weights,
3.2 GB with gradients and Adam's two moments), batch 8 in 4 micro-batches, MSE, 2 Adam steps.
Peaks are ``VmHWM`` from ``/proc/<pid>/status`` of the coordinator and of each stage
(``LocalCluster.pids``), read after the 2 steps and again after ``job.save`` (which streams
weights and optimizer state from the stages through the coordinator to this client). The
baseline trains the unsplit model in a fresh child process and reads its own ``VmHWM``.

Usage: ``python bench/memory.py [--quick]``
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pipesvc

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_STAGES, BATCH, NUM_MICROBATCHES, NUM_STEPS, LR = 4, 8, 4, 2, 1e-4
MiB = 1 << 20


def proc_status_bytes(pid: int, field: str) -> int:
    """``field`` (e.g. ``"VmHWM"``, ``"VmRSS"``) of ``/proc/<pid>/status`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in /proc/{pid}/status")


def _batch(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)


def _one_process(q: Any, width: int, depth: int) -> None:
    importlib.import_module("bench.bench_models")
    idle = proc_status_bytes(os.getpid(), "VmRSS")
    model = pipesvc.models.build("bench-linear", seed=0, width=width, depth=depth)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _batch(width)
    for _ in range(NUM_STEPS):
        opt.zero_grad()
        torch.autograd.backward(F.mse_loss(model(x), y))
        opt.step()
    q.put((idle, proc_status_bytes(os.getpid(), "VmHWM")))


def one_process_peak(width: int, depth: int) -> tuple[int, int]:
    """(RSS after imports, peak RSS) of training the unsplit model in a fresh process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_one_process, args=(q, width, depth), daemon=True)
    proc.start()
    try:
        idle, peak = q.get(timeout=1800)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
    return int(idle), int(peak)


def cluster_peaks(width: int, depth: int) -> tuple[list[int], list[int], list[int], list[str]]:
    """Per process (coordinator first): idle RSS, peak after the steps, peak after a save;
    and the plan's layer ranges."""
    x, y = _batch(width)
    with pipesvc.LocalCluster(
        num_stages=NUM_STAGES, models=["bench.bench_models"], threads_per_stage=1
    ) as cluster:
        pids = cluster.pids
        idle = [proc_status_bytes(p, "VmRSS") for p in pids]
        client = cluster.connect()
        job = client.create_job(
            model="bench-linear",
            model_args={"width": width, "depth": depth},
            num_stages=NUM_STAGES,
            num_microbatches=NUM_MICROBATCHES,
            schedule="1f1b",
            optimizer={"name": "adam", "lr": LR},
            loss="mse",
            partition="parameters",
            checkpoint_every=0,
        )
        for _ in range(NUM_STEPS):
            job.train_step(x, y)
        after_steps = [proc_status_bytes(p, "VmHWM") for p in pids]
        with tempfile.TemporaryDirectory(prefix="pipesvc-bench-") as tmp:
            job.save(Path(tmp) / "checkpoint")
        after_save = [proc_status_bytes(p, "VmHWM") for p in pids]
        ranges = [f"[{s.start_layer}, {s.end_layer})" for s in job.plan]
        job.close()
        client.close()
    return idle, after_steps, after_save, ranges


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 x Linear(1024, 1024)")
    args = parser.parse_args()
    width, depth = (1024, 16) if args.quick else (2048, 48)
    sys.path.insert(0, str(REPO_ROOT))  # spawned children inherit sys.path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # for the stage processes, which import bench.bench_models
    num_params = depth * (width * width + width)
    state_bytes = 4 * num_params * 4  # weights, grads, Adam exp_avg and exp_avg_sq (float32)
    base_idle, base_peak = one_process_peak(width, depth)
    idle, after_steps, after_save, ranges = cluster_peaks(width, depth)

    def mib(n: int) -> str:
        return f"{n / MiB:.0f}"

    print(
        f"\nPeak RSS (VmHWM, MiB): {depth} x Linear({width}, {width}) = {num_params / 1e6:.0f}M "
        f"parameters, weights+grads+Adam = {mib(state_bytes)} MiB; batch {BATCH}, "
        f"{NUM_STEPS} Adam steps;\n{NUM_STAGES} stages, plan {', '.join(ranges)}; "
        "idle = VmRSS before create_job (one process: after imports).\n"
    )
    rows = [["process", "idle", "peak after steps", "peak after job.save"]]
    rows.append(["coordinator", mib(idle[0]), mib(after_steps[0]), mib(after_save[0])])
    for i in range(1, len(idle)):
        rows.append(
            [f"stage process {i - 1}", mib(idle[i]), mib(after_steps[i]), mib(after_save[i])]
        )
    rows.append(["one process (unsplit)", mib(base_idle), mib(base_peak), "-"])
    _print_table(rows)
    largest = (max(after_steps[1:]), max(after_save[1:]))
    share, share_above_idle = base_peak / NUM_STAGES, (base_peak - base_idle) / NUM_STAGES
    ratios = {
        "largest stage / (one-process peak / 4)": [n / share for n in largest],
        "same, above idle RSS": [(n - max(idle[1:])) / share_above_idle for n in largest],
        "largest stage / one-process peak": [n / base_peak for n in largest],
        "coordinator peak / one-process peak": [
            after_steps[0] / base_peak,
            after_save[0] / base_peak,
        ],
    }
    print()
    _print_table(
        [
            ["ratio", "after steps", "after job.save"],
            *[[name, *(f"{v:.2f}" for v in values)] for name, values in ratios.items()],
        ]
    )


if __name__ == "__main__":
    main()
