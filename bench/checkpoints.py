"""What periodic checkpoints cost a training job: ms per step with checkpoints every 10 steps,
and at the default cadence (as often as keeps them within 2% of the training time, at least 10
steps apart; see [Note: checkpoint cadence] in pipesvc/core/cadence.py), against the same job
with ``checkpoint_every=0``.

One ``LocalCluster`` of 2 stages (1 torch thread each) trains four jobs in turn, each for
``--steps`` steps and then closed: two with no checkpoints, one every 10 steps, one at the
default cadence; ``--rounds`` rounds of the four, the order rotating each round. All run on
the same two stage processes, since two jobs on different processes of this host differ by a
few percent on their own. The two jobs without checkpoints measure the noise floor (column
``a/a %``: how far apart two identical jobs come out). AdamW, so a checkpoint carries
weights and two optimizer tensors per parameter. Models:

- tiny: ``bench-mlp`` 4 x (Linear(32, 32) + ReLU), batch 64 in 4 micro-batches, MSE.
- mlp: the built-in ``mlp``, 4 layers of width 1024, batch 64 in 4 micro-batches, MSE
  (about 3M parameters, 38 MB with AdamW's state).
- gpt: ``pipeline.py``'s gpt (6 blocks, embedding 128, sequence 128), batch 16 in 8
  micro-batches, cross-entropy.

Columns: mean ms per step without checkpoints (both such jobs), the noise floor, and for each
cadence its mean ms per step, its overhead over the jobs without in percent, and how many
checkpoints it took per job (the default cadence's first one comes at step 10, before it knows
what one costs).

Usage: ``python bench/checkpoints.py [--rounds 6] [--steps 200] [--models tiny,mlp,gpt]``
(gpt trains a third of ``--steps``: its steps are five times longer)
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


CADENCES: tuple[int | None, ...] = (0, 0, 10, None)
"""checkpoint_every of the four jobs: off twice, every 10 steps, the default."""


def train(client: Any, name: str, every: int | None, steps: int) -> tuple[list[float], int]:
    """Seconds per step of a new job with ``checkpoint_every=every``, and its checkpoints."""
    options = MODELS[name]
    x, y = batch(name)
    job = client.create_job(
        **options,
        num_stages=2,
        optimizer={"name": "adamw", "lr": 1e-4},
        partition="uniform",
        checkpoint_every=every,
    )
    times, taken = [], set()
    try:
        for _ in range(3):  # warm-up
            job.train_step(x, y)
        for _ in range(steps):
            started = time.perf_counter()
            job.train_step(x, y)
            times.append(time.perf_counter() - started)
            taken.add(job.checkpoint_step)
        taken.add(job.refresh().checkpoint_step)
    finally:
        job.close()
    return times, len(taken - {0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--models", default="tiny,mlp,gpt")
    args = parser.parse_args()
    print(
        f"{'model':<6} {'off ms':>8} {'a/a %':>6} {'every 10 ms':>12} {'%':>6} {'taken':>6} "
        f"{'default ms':>11} {'%':>6} {'taken':>6}"
    )
    with (
        pipesvc.LocalCluster(
            num_stages=2, models=["bench.bench_models"], threads_per_stage=1
        ) as cluster,
        cluster.connect() as client,
    ):
        for name in args.models.split(","):
            steps = args.steps // 3 if name == "gpt" else args.steps
            times: list[list[float]] = [[] for _ in CADENCES]
            taken = [0 for _ in CADENCES]
            for turn in range(args.rounds):
                for k in range(len(CADENCES)):
                    which = (turn + k) % len(CADENCES)
                    seconds, count = train(client, name, CADENCES[which], steps)
                    times[which] += seconds
                    taken[which] += count
            off_a, off_b, every_10, default = (1e3 * statistics.fmean(t) for t in times)
            off = (off_a + off_b) / 2
            print(
                f"{name:<6} {off:8.2f} {100 * (off_b / off_a - 1):6.1f} {every_10:12.2f} "
                f"{100 * (every_10 / off - 1):6.1f} {taken[2] / args.rounds:6.1f} "
                f"{default:11.2f} {100 * (default / off - 1):6.1f} {taken[3] / args.rounds:6.1f}"
            )


if __name__ == "__main__":
    main()
