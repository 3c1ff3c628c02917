"""What periodic checkpoints cost a training job: ms per step with checkpoints at the default
interval (every 10 steps) against the same job with ``checkpoint_every=0``.

One ``LocalCluster`` of 4 stages (1 torch thread each) holds two jobs of 2 stages each, one
with checkpoints every 10 steps and one without; they train in turns of ``--block`` steps
(default 20: two checkpoints per turn), so both see the same load, and only one job runs at a
time. AdamW, so a checkpoint carries weights and two optimizer tensors per parameter. Models:

- tiny: ``bench-mlp`` 4 x (Linear(32, 32) + ReLU), batch 64 in 4 micro-batches, MSE.
- mlp: the built-in ``mlp``, 4 layers of width 1024, batch 64 in 4 micro-batches, MSE
  (about 3M parameters, 38 MB with AdamW's state).
- gpt: ``pipeline.py``'s gpt (6 blocks, embedding 128, sequence 128), batch 16 in 8
  micro-batches, cross-entropy.

Columns: mean ms per step (over ``--blocks`` turns of each job), and the overhead of the job
with checkpoints in percent.

Usage: ``python bench/checkpoints.py [--blocks 5] [--block 20] [--models tiny,mlp,gpt]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pipesvc  # noqa: E402
from bench.pipeline import GPT_ARGS  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": "bench-mlp",
        "model_args": {"width": 32, "depth": 4},
        "loss": "mse",
        "num_microbatches": 4,
    },
    "mlp": {
        "model": "mlp",
        "model_args": {
            "in_features": 1024,
            "hidden_features": 1024,
            "num_layers": 4,
            "out_features": 8,
        },
        "loss": "mse",
        "num_microbatches": 4,
    },
    "gpt": {"model": "gpt", "model_args": GPT_ARGS, "loss": "cross_entropy", "num_microbatches": 8},
}


def batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "gpt":
        ids = torch.randint(0, GPT_ARGS["vocab_size"], (16, GPT_ARGS["block_size"]), generator=g)
        return ids, ids
    width = {"tiny": 32, "mlp": 1024}[name]
    out = {"tiny": 32, "mlp": 8}[name]
    return torch.randn(64, width, generator=g), torch.randn(64, out, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--models", default="tiny,mlp,gpt")
    args = parser.parse_args()
    print(f"{'model':<6} {'off ms':>8} {'every 10 ms':>12} {'overhead %':>11}")
    with (
        pipesvc.LocalCluster(
            num_stages=4, models=["bench.bench_models"], threads_per_stage=1
        ) as cluster,
        cluster.connect() as client,
    ):
        for name in args.models.split(","):
            options = MODELS[name]
            x, y = batch(name)
            jobs = [
                client.create_job(
                    **options,
                    num_stages=2,
                    optimizer={"name": "adamw", "lr": 1e-4},
                    partition="uniform",
                    checkpoint_every=every,
                )
                for every in (0, 10)
            ]
            times: list[list[float]] = [[], []]
            try:
                for job in jobs:  # warm-up
                    for _ in range(3):
                        job.train_step(x, y)
                for turn in range(2 * args.blocks):
                    which = turn % 2 if turn % 4 < 2 else 1 - turn % 2
                    job = jobs[which]
                    for _ in range(args.block):
                        started = time.perf_counter()
                        job.train_step(x, y)
                        times[which].append(time.perf_counter() - started)
            finally:
                for job in jobs:
                    job.close()
            off, on = (1e3 * statistics.fmean(t) for t in times)
            print(f"{name:<6} {off:8.2f} {on:12.2f} {100 * (on / off - 1):11.1f}")


if __name__ == "__main__":
    main()
