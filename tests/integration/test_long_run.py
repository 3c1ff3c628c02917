"""A few hundred steps on real processes: threads, fds and state files must stop growing; and
over 120 aborted runs and 24 stage restarts, the coordinator's gradient-store keys, its
registry of stages (in memory and in SQLite) and the stages' parked collectives stay flat.

No timing is asserted; only counts that a leak would make grow with the number of steps,
checkpoints, aborts or restarts.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.faults import free_port

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


ABORTS, RESTARTS = 120, 24
FORGET_S = 3.0
"""``--forget-stages-after-s`` of the coordinator below: six of its stages' heartbeats."""
_METRICS_URL = re.compile(r"serving Prometheus metrics on (http://\S+/metrics)")
_ADVERTISED = re.compile(r"advertised as (\S+), device")


def _gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf"^pipesvc_{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{url} has no pipesvc_{name}"
    return float(found[1])


def _log_urls(cluster: pipesvc.LocalCluster) -> dict[str, str]:
    """Each process's metrics URL, by its log's name (``coordinator``) or its stage address."""
    urls = {}
    for log in cluster.log_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        url = _METRICS_URL.search(text)
        where = _ADVERTISED.search(text)
        if url is not None:
            urls[where[1] if where is not None else log.stem] = url[1]
    return urls


@dataclass(frozen=True)
class Held:
    store_keys: float
    registered: float
    listed: int
    rows: int
    parked: dict[str, float]


@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_store_keys_registry_and_parked_collectives_stay_flat(tmp_path: Path) -> None:
    """120 aborted runs (training and inference, each followed by a step whose gradient
    groups form anew) and 24 restarts of a spare stage on a new port: the counts after the
    first quarter and at the end are the same (see [Note: store keys] and [Note: forgetting
    stages])."""
    state_dir = tmp_path / "state"
    with pipesvc.LocalCluster(
        num_stages=2,
        threads_per_stage=1,
        state_dir=state_dir,
        coordinator_args=[
            *("--store-port", str(free_port())),
            *("--metrics-port", "0"),
            *("--forget-stages-after-s", str(FORGET_S)),
        ],
        stage_args=["--metrics-port", "0", "--heartbeat-interval-s", "0.5"],
    ) as cluster:
        spare = cluster.add_stage()
        client = cluster.connect()
        job = client.create_job(
            model="mlp",
            num_stages=1,
            data_parallel=2,
            num_microbatches=2,
            optimizer={"name": "sgd", "lr": 1e-3},
            loss="mse",
        )
        urls = _log_urls(cluster)
        coordinator = urls["coordinator"]
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)

        def held() -> Held:
            time.sleep(FORGET_S + 2)  # the dead spares are forgotten, the gauges refreshed
            with sqlite3.connect(state_dir / "state.sqlite3") as db:
                rows = db.execute("SELECT COUNT(*) FROM stages").fetchone()[0]
            return Held(
                store_keys=_gauge(coordinator, "gradient_store_keys"),
                registered=_gauge(coordinator, "registered_stages"),
                listed=len(client.stages()),
                rows=rows,
                parked={s.address: _gauge(urls[s.address], "parked_collectives") for s in job.plan},
            )

        seen: dict[int, Held] = {}
        for i in range(1, ABORTS + 1):
            if i % 2:
                with pytest.raises(pipesvc.InvalidArgumentError):
                    job.train_step(x, y[:, :3])  # the loss refuses it on the last stage
            else:
                with pytest.raises(pipesvc.InvalidArgumentError):
                    job.forward(x[:, :5])
            job.train_step(x, y)  # a new generation: its groups form anew
            if i % (ABORTS // RESTARTS) == 0:
                os.kill(spare, signal.SIGKILL)
                spare = cluster.add_stage()
            if i in (ABORTS // 4, ABORTS):
                seen[i] = held()
        assert (
            _gauge(coordinator, "steps_aborted_total") >= ABORTS
        )  # a run carrying a commit goes twice
        job.close()
        warm, last = seen[ABORTS // 4], seen[ABORTS]
        print(f"after {ABORTS // 4} aborts: {warm}; after {ABORTS}: {last}")
        assert last == warm
        assert warm.store_keys > 0, "the job's current groups are in the store"
        assert (warm.registered, warm.listed, warm.rows) == (3, 3, 3), "the 3 live stages"
