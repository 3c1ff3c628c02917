"""A stage planned to fill its memory budget is reassigned on every recovery: it holds one copy
of its model through it (the old one released before the new one is built, and the restored
optimizer state checked and taken without a copy), not two.

The stages run with glibc's mmap threshold at 1 MiB (``MALLOC_MMAP_THRESHOLD_``, which a stage
leaves as the environment gives it): every tensor of a layer is mapped on its own and unmapped
when freed, so resident memory is what the stage holds. Under the stage's own setting (tensors
in the heap) it also counts freed heap pages, in whatever layout the rebuild leaves: with 4
layers of 16 MiB, 0 to 38 MiB of growth with one copy and 32 to 64 MiB with two were measured,
too close to tell apart. This way, on a loaded machine, one copy measures 9-12 MiB (the step's
transient gradient of one 4 MiB layer, and small buffers) and two copies 32 MiB."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.stage_probe import stage_info

MIB = 2**20
WIDTH = 1024  # each of the 16 layers: 4 MiB of float32 weights
# Eight layers a stage: weights, gradients and SGD's momentum are 96 MiB, which the budget fits;
# a second copy of the weights beside them (128 MiB) it does not. Many small layers keep a step's
# transient (one layer's gradient) small beside a second copy of the weights.
BUDGET = 112 * MIB
OPTIONS = {
    "model": "mlp",
    "model_args": {
        "in_features": WIDTH,
        "hidden_features": WIDTH,
        "out_features": WIDTH,
        "num_layers": 16,
    },
    "num_stages": 2,
    "num_microbatches": 2,
    "loss": "mse",
    "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
    "partition": "memory",
    "checkpoint_every": 1,
}


def status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_stage_that_fills_its_budget_holds_one_copy_through_a_recovery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MIB))  # the stages' environment
    with (
        pipesvc.LocalCluster(
            num_stages=3, threads_per_stage=1, stage_args=["--memory-budget", str(BUDGET)]
        ) as cluster,
        cluster.connect() as client,
        client.create_job(**OPTIONS) as job,  # type: ignore[arg-type]
    ):
        assert [(s.start_layer, s.end_layer) for s in job.plan] == [(0, 8), (8, 16)]
        batch = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
        for _ in range(3):
            job.train_step(*batch)
        # The checkpoint of step 2 streams from the stages' snapshots in the background; the
        # measure starts once it is on disk, so that a stream cut off by the kill below (its
        # messages queued in the stage) is not counted as the reassign's memory.
        deadline = time.monotonic() + 60
        while job.refresh().checkpoint_step < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.checkpoint_step >= 2
        survivor, lost = (stage_info(s.address).pid for s in job.plan)
        held = status_bytes(survivor, "VmRSS")
        Path(f"/proc/{survivor}/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
        os.kill(lost, signal.SIGKILL)
        job.train_step(*batch)  # the survivor is reassigned, restored and runs the step again
        assert job.recoveries == 1
        assert stage_info(job.plan[0].address).pid == survivor
        grown = status_bytes(survivor, "VmHWM") - held
        # Two copies add the new weights (eight layers, 32 MiB), and so did the check of the
        # restored state that copied its momentum; one copy adds only what any step does.
        assert grown < 20 * MIB, (grown / MIB, held / MIB)
