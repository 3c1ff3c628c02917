"""Training on stages of different speeds: 4 stages, one capped at a quarter of a CPU.

Model: the built-in ``mlp`` with 16 layers of width 1024 (a Linear + ReLU each, and the last a
Linear to 8 outputs), batch 64 in 4 micro-batches, MSE, SGD; ``LocalCluster(num_stages=4,
threads_per_stage=1)``. The stage process that the first job puts at rank 1 runs in a cgroup
(v1 cpu controller) with ``cpu.cfs_quota_us`` a quarter of its period; every job uses all four
stages, so that process takes part in every row.

Rows (steps/s over ``--steps`` timed steps, after the job's own warm-up):

- ``parameters``: ranges balancing parameter counts (equal work here), the capped stage
  included like the others.
- ``throughput``: starts like ``parameters``; after its 3 probe steps the job measures the
  stages and re-plans (see README "Uneven clusters").
- ``parameters + rebalance``: ``rebalance=True``; the job measures at step 20 and moves.
- ``uncapped``: ``parameters`` with the cap lifted (what the cluster does without a slow stage).

``layers`` lists each rank's layer count, ``*`` marking the capped stage; ``x`` is steps/s
against the ``parameters`` row.

Usage: ``python bench/uneven.py [--steps N]`` (needs root for the cgroup).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pipesvc  # noqa: E402
from pipesvc.core.settle import PROBE_STEPS, REBALANCE_EVERY  # noqa: E402
from tests.support.cpu_cap import cpu_capped  # noqa: E402
from tests.support.faults import stage_pid  # noqa: E402

ARGS = {"in_features": 1024, "hidden_features": 1024, "num_layers": 16, "out_features": 8}
BATCH = 64


def run(
    client: pipesvc.Client, name: str, warm: int, steps: int, slow: str, **options: object
) -> tuple[float, str]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, ARGS["in_features"], generator=g)
    y = torch.randn(BATCH, ARGS["out_features"], generator=g)
    with client.create_job(
        model="mlp",
        model_args=ARGS,
        num_stages=4,
        num_microbatches=4,
        loss="mse",
        optimizer={"name": "sgd", "lr": 1e-4},
        **options,  # type: ignore[arg-type]
    ) as job:
        for _ in range(warm):
            job.train_step(x, y)
        started = time.perf_counter()
        for _ in range(steps):
            job.train_step(x, y)
        took = time.perf_counter() - started
        job.refresh()
        layers = " ".join(
            f"{s.end_layer - s.start_layer}{'*' if s.address == slow else ''}" for s in job.plan
        )
    return steps / took, layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument(
        "--reports", action="store_true", help="print the coordinator's measurement reports"
    )
    args = parser.parse_args()
    with (
        pipesvc.LocalCluster(num_stages=4, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        with client.create_job(model="mlp", model_args=ARGS, num_stages=4) as job:
            slow = job.plan[1].address
        pid = stage_pid(slow)
        print(f"{'run':<26} {'layers':<14} {'steps/s':>8} {'x':>6}")
        rows = []
        with cpu_capped(pid, 0.25):
            rows.append(("parameters", *run(client, "parameters", 3, args.steps, slow)))
            rows.append(
                (
                    "throughput",
                    *run(client, "t", PROBE_STEPS + 1, args.steps, slow, partition="throughput"),
                )
            )
            rows.append(
                (
                    "parameters + rebalance",
                    *run(client, "r", REBALANCE_EVERY + 1, args.steps, slow, rebalance=True),
                )
            )
        rows.append(("uncapped", *run(client, "u", 3, args.steps, slow)))
        base = rows[0][1]
        for name, rate, layers in rows:
            print(f"{name:<26} {layers:<14} {rate:8.2f} {rate / base:6.2f}")
        if args.reports:
            log = (cluster.log_dir / "coordinator.log").read_text(errors="replace")
            print("\n".join(re.findall(r"measured\n(?:.*\n){5}", log)))


if __name__ == "__main__":
    main()
