"""Training steps/s: pipesvc vs torch.distributed.pipelining vs one process, same model.

Model: 8 x (Linear(1024, 1024) + ReLU), batch 64 in 8 micro-batches, MSE loss, SGD, split
uniformly (equal layer counts) over 2 or 4 stages, one torch thread per stage process.

- torch: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` over gloo, one process per
  stage (``init_method=tcp://127.0.0.1:PORT``).
- pipesvc: ``LocalCluster(num_stages=N, threads_per_stage=1)``, i.e. a coordinator plus N stage
  processes; timed from the client (``job.train_step``), checkpoints off (``checkpoint_every=0``).
- one process: the unsplit model on the whole batch, 1 and 2 threads.

Usage: ``python bench/pipeline.py [--quick]``
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pipesvc

REPO_ROOT = Path(__file__).resolve().parents[1]
WIDTH, DEPTH, BATCH, NUM_MICROBATCHES, LR = 1024, 8, 64, 8, 1e-3
WARMUP_STEPS = 3
SCHEDULES = ("gpipe", "1f1b")
STAGE_COUNTS = (2, 4)
Queue = Any  # multiprocessing.Queue


def _model() -> torch.nn.Sequential:
    importlib.import_module("bench.bench_models")
    return pipesvc.models.build("bench-mlp", seed=0, width=WIDTH, depth=DEPTH)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def _time_steps(step: Any, num_steps: int, barrier: Any = None) -> float:
    """Seconds for ``num_steps`` calls of ``step`` after the warm-up ones."""
    for _ in range(WARMUP_STEPS):
        step()
    if barrier is not None:
        barrier()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    if barrier is not None:
        barrier()
    return time.perf_counter() - start


def _one_process(q: Queue, num_threads: int, num_steps: int) -> None:
    torch.set_num_threads(num_threads)
    model, (x, y) = _model(), _batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad()
        torch.autograd.backward(F.mse_loss(model(x), y))
        opt.step()

    q.put(("ok", _time_steps(step, num_steps)))


def _torch_stage(
    q: Queue, rank: int, world: int, address: str, schedule: str, num_steps: int
) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        per_stage = DEPTH // world
        submodule = _model()[rank * per_stage : (rank + 1) * per_stage]
        stage = PipelineStage(submodule, rank, world, torch.device("cpu"))
        schedule_cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        pipe = schedule_cls(stage, n_microbatches=NUM_MICROBATCHES, loss_fn=F.mse_loss)
        opt = torch.optim.SGD(submodule.parameters(), lr=LR)
        x, y = _batch()

        def step() -> None:
            opt.zero_grad()
            if rank == 0:
                pipe.step(x)
            elif rank == world - 1:
                pipe.step(target=y, losses=[])
            else:
                pipe.step()
            opt.step()

        seconds = _time_steps(step, num_steps, dist.barrier)
        dist.destroy_process_group()
        if rank == 0:
            q.put(("ok", seconds))
    except Exception as exc:
        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _run_children(targets: list[tuple[Any, tuple[Any, ...]]]) -> float | str:
    """Runs the processes; returns rank 0's seconds, or the first error message."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=t, args=(q, *a), daemon=True) for t, a in targets]
    for proc in procs:
        proc.start()
    try:
        status, value = q.get(timeout=900)
    except Exception as exc:
        status, value = "error", f"no result within 900 s ({type(exc).__name__})"
    for proc in procs:
        proc.join(timeout=30 if status == "ok" else 1)
        if proc.is_alive():
            proc.terminate()
    return float(value) if status == "ok" else str(value)


def torch_pipelining(schedule: str, world: int, num_steps: int) -> float | str:
    """Steps/s of torch.distributed.pipelining, or why it failed."""
    address = _free_address()
    targets = [(_torch_stage, (r, world, address, schedule, num_steps)) for r in range(world)]
    result = _run_children(targets)
    return num_steps / result if isinstance(result, float) else result


def one_process(num_threads: int, num_steps: int) -> float:
    """Steps/s of the unsplit model in a fresh process."""
    result = _run_children([(_one_process, (num_threads, num_steps))])
    if isinstance(result, str):
        raise RuntimeError(result)
    return num_steps / result


def pipesvc_steps_per_s(num_stages: int, num_steps: int) -> dict[str, float]:
    """Steps/s per schedule on a fresh local cluster of ``num_stages`` stages."""
    x, y = _batch()
    rates = {}
    with pipesvc.LocalCluster(
        num_stages=num_stages, models=["bench.bench_models"], threads_per_stage=1
    ) as cluster:
        client = cluster.connect()
        for schedule in SCHEDULES:
            job = client.create_job(
                model="bench-mlp",
                model_args={"width": WIDTH, "depth": DEPTH},
                num_stages=num_stages,
                num_microbatches=NUM_MICROBATCHES,
                schedule=schedule,
                optimizer={"name": "sgd", "lr": LR},
                loss="mse",
                partition="uniform",
                checkpoint_every=0,
            )
            seconds = _time_steps(lambda j=job: j.train_step(x, y), num_steps)
            rates[schedule] = num_steps / seconds
            job.close()
        client.close()
    return rates


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 timed steps instead of 20")
    args = parser.parse_args()
    num_steps = 10 if args.quick else 20
    sys.path.insert(0, str(REPO_ROOT))  # spawned children inherit sys.path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # for the stage processes, which import bench.bench_models
    single = {n: one_process(n, num_steps) for n in (1, 2)}
    errors: dict[str, str] = {}
    rows = [["schedule", "stages", "torch steps/s", "pipesvc steps/s", "pipesvc/torch"]]
    rows[0].append("pipesvc/1proc(2thr)")
    for num_stages in STAGE_COUNTS:
        ours = pipesvc_steps_per_s(num_stages, num_steps)
        for schedule in SCHEDULES:
            theirs = torch_pipelining(schedule, num_stages, num_steps)
            if isinstance(theirs, str):
                errors[f"{schedule} x {num_stages}"] = theirs
            ratio = f"{ours[schedule] / theirs:.2f}" if isinstance(theirs, float) else "n/a"
            torch_cell = f"{theirs:.2f}" if isinstance(theirs, float) else "failed"
            rows.append(
                [
                    schedule,
                    str(num_stages),
                    torch_cell,
                    f"{ours[schedule]:.2f}",
                    ratio,
                    f"{ours[schedule] / single[2]:.2f}",
                ]
            )
    print(
        f"\nTraining steps/s, {DEPTH} x (Linear({WIDTH}, {WIDTH}) + ReLU), batch {BATCH} in "
        f"{NUM_MICROBATCHES} micro-batches, MSE, SGD; {WARMUP_STEPS} warm-up + {num_steps} "
        f"timed steps;\n1 thread per stage process (pipesvc adds a coordinator process); "
        f"{os.cpu_count()} CPU cores.\n"
    )
    _print_table(rows)
    print()
    _print_table(
        [
            ["one process, whole batch", "steps/s", "vs 2 threads"],
            ["1 thread", f"{single[1]:.2f}", f"{single[1] / single[2]:.2f}"],
            ["2 threads", f"{single[2]:.2f}", "1.00"],
        ]
    )
    for where, message in errors.items():
        print(f"\ntorch.distributed.pipelining failed ({where}):\n{message}")


if __name__ == "__main__":
    main()
