"""Training on stages of different speeds: 4 stages, one capped at a quarter of a CPU.

Model: the built-in ``mlp`` with 16 layers of width 1024 (a Linear + ReLU each, and the last a
Linear to 8 outputs), batch 64 in 4 micro-batches, MSE, SGD; ``LocalCluster(num_stages=4,
threads_per_stage=1)``. The stage process that the first job puts at rank 1 runs in a cgroup
(v1 cpu controller) with ``cpu.cfs_quota_us`` a quarter of its period; every job uses all four
stages, so that process takes part in every row.

Rows (steps/s over ``--steps`` timed steps, 40 by default):

- ``parameters``: ranges balancing parameter counts (equal work here), the capped stage
  included like the others; timed after 3 warm-up steps.
- ``throughput``: starts like ``parameters``; after its probe steps the job measures the
  stages and re-plans (see README "Uneven clusters"). Timed from the step after its first
  move, so any later move's cost counts.
- ``parameters + rebalance``: ``rebalance=True``; the job measures at step 20 (or sooner, if
  its step time changes) and moves; timed from the step after its first move.
- ``uncapped``: ``parameters`` with the cap lifted (what the cluster does without a slow stage).

``layers`` lists each rank's layer count at the end, ``*`` marking the capped stage; ``moves``
counts the job's moves in all (in the timed steps after the slash), from the coordinator's
log; ``x`` is steps/s against the ``parameters`` row.

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
from tests.support.cpu_cap import cpu_capped  # noqa: E402
from tests.support.faults import stage_pid  # noqa: E402

ARGS = {"in_features": 1024, "hidden_features": 1024, "num_layers": 16, "out_features": 8}
BATCH = 64


MAX_WARM = 40
"""The most steps a job that re-plans trains before its timed steps, waiting for its first move."""


def run(
    client: pipesvc.Client,
    log: Path,
    steps: int,
    slow: str,
    *,
    until_move: bool = False,
    **options: object,
) -> tuple[float, str, str]:
    """Steps/s over ``steps`` timed steps (after 3 warm-up steps, or once the job first moved),
    its final layer counts, and its moves ("all/timed")."""
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
        warm = 0
        while warm < (MAX_WARM if until_move else 3):
            job.train_step(x, y)
            warm += 1
            if until_move and _moves(log, job.id):
                break
        started = time.perf_counter()
        for _ in range(steps):
            job.train_step(x, y)
        took = time.perf_counter() - started
        job.refresh()
        layers = " ".join(
            f"{s.end_layer - s.start_layer}{'*' if s.address == slow else ''}" for s in job.plan
        )
        moves = _moves(log, job.id)
    timed = sum(1 for step in moves if step > warm)
    return steps / took, layers, f"{len(moves)}/{timed}"


def _moves(log: Path, job_id: str) -> list[int]:
    """The steps at which the coordinator's log says job ``job_id`` moved."""
    text = log.read_text(errors="replace")
    pattern = rf"job {re.escape(job_id)}: moving to a new plan at step (\d+)"
    return [int(step) for step in re.findall(pattern, text)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--reports", action="store_true", help="print the coordinator's measurement reports"
    )
    args = parser.parse_args()
    with (
        pipesvc.LocalCluster(num_stages=4, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        log = cluster.log_dir / "coordinator.log"
        with client.create_job(model="mlp", model_args=ARGS, num_stages=4) as job:
            slow = job.plan[1].address
        pid = stage_pid(slow)
        rows = []
        with cpu_capped(pid, 0.25):
            rows.append(("parameters", *run(client, log, args.steps, slow)))
            rows.append(
                (
                    "throughput",
                    *run(client, log, args.steps, slow, until_move=True, partition="throughput"),
                )
            )
            rows.append(
                (
                    "parameters + rebalance",
                    *run(client, log, args.steps, slow, until_move=True, rebalance=True),
                )
            )
        rows.append(("uncapped", *run(client, log, args.steps, slow)))
        base = rows[0][1]
        print(f"{'run':<24} {'layers':<14} {'moves':>6} {'steps/s':>8} {'x':>6}")
        for name, rate, layers, moves in rows:
            print(f"{name:<24} {layers:<14} {moves:>6} {rate:8.2f} {rate / base:6.2f}")
        if args.reports:
            text = log.read_text(errors="replace")
            print("\n".join(re.findall(r"measured\n(?:.*\n){5}", text)))


if __name__ == "__main__":
    main()
