"""A few hundred steps on real processes: threads, fds and state files must stop growing.

No timing is asserted; only counts that a leak would make grow with the number of steps or
checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import pipesvc

NUM_STAGES = 2
NUM_LAYERS = 4
"""The built-in ``mlp`` with its defaults: three Linear + ReLU blocks and a Linear."""
CHECKPOINT_EVERY = 20
KEPT_CHECKPOINTS = 2
"""``CheckpointStore``'s default ``keep``."""
WARM_STEPS, LAST_STEP = 100, 300
THREAD_SLACK = NUM_STAGES
"""The coordinator's maintenance loop health-checks the job's stages from a pool of one thread
per stage, which may be alive at the moment the threads are counted; nothing else in any
process starts threads between steps once the first steps have run."""
FD_SLACK = NUM_STAGES
"""A health check may open a connection to each of the job's stages while fds are counted."""


@dataclass(frozen=True)
class Counts:
    threads: dict[int, int]
    fds: dict[int, int]
    files: int


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no Threads line")


def _files(root: Path) -> int:
    return sum(len(names) for _, _, names in os.walk(root))


def _counts(pids: list[int], job_dir: Path) -> Counts:
    return Counts(
        threads={pid: _threads(pid) for pid in pids},
        fds={pid: len(os.listdir(f"/proc/{pid}/fd")) for pid in pids},
        files=_files(job_dir),
    )


@pytest.mark.timeout(120)
def test_threads_fds_and_state_files_stay_bounded(
    cluster: pipesvc.LocalCluster, client: pipesvc.Client
) -> None:
    job = client.create_job(
        model="mlp",
        num_stages=NUM_STAGES,
        num_microbatches=4,
        schedule="1f1b",
        optimizer={"name": "sgd", "lr": 1e-3},
        loss="mse",
        checkpoint_every=CHECKPOINT_EVERY,
    )
    job_dir = cluster.log_dir / "state" / "jobs" / job.id
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen)
    # A periodic checkpoint is written in the background and counts once durable, when the
    # step log behind it is pruned (see [Note: background checkpoint]): at any time there are
    # the kept checkpoints' layer files and manifests, at most one checkpoint being written,
    # and the logged steps since the newest one that counts (it is applied at the latest when
    # the next one starts: fewer than 2 x CHECKPOINT_EVERY).
    at_most = (KEPT_CHECKPOINTS + 1) * (NUM_LAYERS + 1) + 2 * CHECKPOINT_EVERY - 1
    most_files = 0
    seen: dict[int, Counts] = {}
    try:
        while job.step < LAST_STEP:
            job.train_step(x, y)
            if job.step >= WARM_STEPS:
                most_files = max(most_files, _files(job_dir))
            if job.step in (WARM_STEPS, LAST_STEP):
                seen[job.step] = _counts(cluster.pids, job_dir)
    finally:
        job.close()
    warm, last = seen[WARM_STEPS], seen[LAST_STEP]
    assert warm.files <= at_most and last.files <= at_most, (warm.files, last.files, at_most)
    assert most_files <= at_most, most_files
    for pid in cluster.pids:
        assert last.threads[pid] <= warm.threads[pid] + THREAD_SLACK, (
            f"pid {pid}: {warm.threads[pid]} threads at step {WARM_STEPS}, "
            f"{last.threads[pid]} at step {LAST_STEP}"
        )
        assert last.fds[pid] <= warm.fds[pid] + FD_SLACK, (
            f"pid {pid}: {warm.fds[pid]} fds at step {WARM_STEPS}, "
            f"{last.fds[pid]} at step {LAST_STEP}"
        )
