"""The fault matrix at real sizes: a stage killed in every phase, under every schedule and path.

Each case trains a job on a local cluster whose stages carry a ``--fault-kill`` point, so one
stage SIGKILLs itself once, at a chosen phase of a chosen step; a spare takes its place. The
same job is then trained again on the same cluster (the fault has fired, so it does not fire
again) and both runs must agree to 1e-6 in every loss and every weight: the computation is the
same, so a recovery that lost, repeated or reordered a step, or replayed dropout differently,
fails. Every case runs past at least two periodic checkpoints, and every stage but the killed
one must still be the same process at the end (a fault must not take a healthy neighbour, or
a replica's stage, down with it).

Each case runs once calling ``train_step`` per step and (all but two, see ``STEPPED_ONLY``)
once streaming the batches through ``job.train``, whose runs go ahead of their step's
decision; the clean run it is compared with always calls ``train_step``. The cases cover every
schedule (zb-h1's split backward included), more micro-batches than a link's send queue holds,
activations of several MiB per micro-batch on the shared-memory path and on frames, Adam with
clipping, the ``gpt`` with dropout, a model with parameter-free layers (the ``cnn``'s Flatten),
faults in forward, backward, commit and during a checkpoint, and replicated jobs (data
parallel x pipeline) and stages holding several layer ranges (``interleaved-1f1b``) at the
same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import pipesvc
from pipesvc.stage.dataplane.sender import SEND_QUEUE_ITEMS
from tests.support.faults import stage_pid
from tests.support.metrics import coordinator_metric
from tests.support.reference import PROBLEMS, Problem

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]

SAME = {"rtol": 0.0, "atol": 1e-6}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
ADAMW = {"name": "adamw", "lr": 1e-2}

# 4 MiB crosses the boundary per micro-batch: 32 images of 8 x 64 x 64 floats after two
# conv blocks, with the uniform partition cutting the cnn after its second block.
BIG_CNN = Problem(
    "cnn",
    {"in_channels": 1, "image_size": 256, "num_classes": 5, "channels": [8, 8]},
    "cross_entropy",
    (1, 256, 256),
    num_classes=5,
)
GPT_DROPOUT = Problem(
    "gpt",
    {**PROBLEMS["gpt"].model_args, "dropout": 0.2},
    "cross_entropy",
    PROBLEMS["gpt"].input_shape,
)


@dataclass(frozen=True)
class Case:
    """One cell of the matrix."""

    fault: str  # WHEN:STEP:RANK
    problem: Problem = PROBLEMS["cnn"]
    schedule: str = "1f1b"
    num_stages: int = 2
    num_microbatches: int = 4
    batch_size: int = 8
    steps: int = 6
    checkpoint_every: int = 2
    optimizer: dict[str, Any] = field(default_factory=lambda: dict(SGD))
    clip_grad_norm: float | None = None
    shm: bool = True
    partition: str = "parameters"
    virtual_stages: int = 1
    """Layer ranges per stage (``interleaved-1f1b``)."""
    data_parallel: int = 1
    """Replicas; the fault flag is on every stage, so the first stage of its rank to reach
    the point dies (in whichever replica)."""

    @property
    def rank(self) -> int:
        return int(self.fault.split(":")[2])


CASES = {
    # A model with a parameter-free layer, past two checkpoints before and after the fault.
    "cnn-1f1b-forward-3stages": Case("forward:5:1", num_stages=3, steps=7),
    "cnn-gpipe-backward-frames": Case("backward:4:0", schedule="gpipe", shm=False),
    # More micro-batches than a link's send queue holds.
    "mlp-gpipe-queue-backward": Case(
        "backward:3:1",
        problem=PROBLEMS["mlp"],
        schedule="gpipe",
        num_microbatches=SEND_QUEUE_ITEMS + 16,
        batch_size=2 * (SEND_QUEUE_ITEMS + 16),
        steps=5,
    ),
    # Several MiB per micro-batch on each path.
    "big-shm-1f1b-backward": Case(
        "backward:3:1",
        problem=BIG_CNN,
        batch_size=128,
        steps=5,
        partition="uniform",
    ),
    "big-frames-gpipe-forward": Case(
        "forward:3:0",
        problem=BIG_CNN,
        schedule="gpipe",
        batch_size=128,
        steps=5,
        partition="uniform",
        shm=False,
    ),
    # Adam with clipping, killed at the commit.
    "mlp-adamw-clip-commit": Case(
        "commit:5:0",
        problem=PROBLEMS["mlp"],
        optimizer=dict(ADAMW),
        clip_grad_norm=0.5,
    ),
    # Dropout: the replay must draw the same masks.
    "gpt-dropout-backward": Case(
        "backward:4:1", problem=GPT_DROPOUT, optimizer=dict(ADAMW), clip_grad_norm=1.0
    ),
    # Split backward (zero bubble): killed among its input- and weight-gradient passes.
    "gpt-dropout-zb-h1-backward": Case(
        "backward:4:1", problem=GPT_DROPOUT, schedule="zb-h1", optimizer=dict(ADAMW)
    ),
    # Killed while its state streams into the step-4 checkpoint.
    "cnn-checkpoint": Case("checkpoint:4:1", steps=7),
    # Replicas (data parallel): MiB-sized activations and gradient sums, split backward.
    "big-replicas-zb-h1-backward": Case(
        "backward:3:1",
        problem=BIG_CNN,
        schedule="zb-h1",
        batch_size=256,
        steps=5,
        partition="uniform",
        data_parallel=2,
    ),
    # Virtual stages: the killed stage's chunks all move to the spare, the ring re-forms.
    "mlp-interleaved-forward": Case(
        "forward:3:1",
        problem=PROBLEMS["mlp"],
        schedule="interleaved-1f1b",
        virtual_stages=2,
        num_microbatches=SEND_QUEUE_ITEMS + 4,
        batch_size=2 * (SEND_QUEUE_ITEMS + 4),
        steps=5,
        partition="uniform",
    ),
    # Replicas with more micro-batches per replica than a send queue holds, killed at commit.
    "mlp-replicas-queue-commit": Case(
        "commit:3:0",
        problem=PROBLEMS["mlp"],
        schedule="gpipe",
        num_microbatches=SEND_QUEUE_ITEMS + 4,
        batch_size=4 * (SEND_QUEUE_ITEMS + 4),
        steps=5,
        optimizer=dict(ADAMW),
        clip_grad_norm=0.5,
        data_parallel=2,
    ),
}


@dataclass
class Outcome:
    losses: list[float]
    weights: dict[str, torch.Tensor]
    recoveries: int


def _create(client: pipesvc.Client, case: Case) -> pipesvc.Job:
    return client.create_job(
        model=case.problem.model,
        model_args=case.problem.model_args,
        seed=5,
        num_stages=case.num_stages,
        data_parallel=case.data_parallel,
        virtual_stages=case.virtual_stages,
        num_microbatches=case.num_microbatches,
        schedule=case.schedule,
        loss=case.problem.loss,
        optimizer=case.optimizer,
        clip_grad_norm=case.clip_grad_norm,
        checkpoint_every=case.checkpoint_every,
        partition=case.partition,
    )


def _train(job: pipesvc.Job, case: Case, via: str = "train_step") -> Outcome:
    batches = [case.problem.batch(case.batch_size, seed=100 + step) for step in range(case.steps)]
    if via == "train":
        losses = list(job.train(batches))
    else:
        losses = [job.train_step(x, y) for x, y in batches]
    return Outcome(losses, job.state_dict(), job.refresh().recoveries)


_CLEAN: dict[str, Outcome] = {}
"""Each case's clean ``train_step`` run, once per session: both of its faulty runs compare
with it (the clean run is a deterministic function of the case)."""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


STEPPED_ONLY = {"big-frames-gpipe-forward", "big-replicas-zb-h1-backward"}
"""Cells not run through ``job.train`` too: their MiB-sized tensors test the data plane, which
``job.train`` does not change, and what else they add (frames, replicas, a split backward) is
in other cells run through it; they take 90 of the 210 s that ``job.train``'s cells take."""
RUNS = [(name, "train_step") for name in CASES] + [
    (name, "train") for name in CASES if name not in STEPPED_ONLY
]


@pytest.mark.parametrize(("name", "via"), RUNS)
def test_fault_costs_nothing(name: str, via: str, tmp_path: Path) -> None:
    """The faulty run calls ``train_step`` per step, or streams the batches through
    ``job.train`` (see [Note: steps ahead] in pipesvc.coordinator.step_runner)."""
    case = CASES[name]
    marker = tmp_path / "fired"
    stage_args = ["--fault-kill", f"{case.fault}:{marker}"]
    if not case.shm:
        stage_args += ["--shm-bytes", "0"]
    with (
        pipesvc.LocalCluster(
            num_stages=case.num_stages * case.data_parallel + 1,
            threads_per_stage=1,
            coordinator_args=["--metrics-port", "0"],
            stage_args=stage_args,
        ) as cluster,
        cluster.connect() as client,
    ):
        job = _create(client, case)
        pids = {(s.replica, s.rank): stage_pid(s.address) for s in job.plan if s.chunk == 0}
        faulty = _train(job, case, via)
        assert marker.exists(), "the fault never fired"
        # A clipping job with replicas takes the coordinator's scale: its runs never go ahead.
        ahead = case.clip_grad_norm is None or case.data_parallel == 1
        if via == "train" and ahead:
            assert coordinator_metric(cluster, "runs_sent_ahead_total") >= 1, "none went ahead"
        assert faulty.recoveries == 1
        dead = [where for where, pid in pids.items() if not _alive(pid)]
        assert [rank for _, rank in dead] == [case.rank], f"dead stages (replica, rank): {dead}"
        survivors = {pid for where, pid in pids.items() if where not in dead}
        assert pid_set(job) >= survivors, "a healthy stage died with the faulty one"
        job.close()

        clean = _CLEAN.get(name)
        if clean is None:
            clean_job = _create(client, case)
            clean = _CLEAN[name] = _train(clean_job, case)
            clean_job.close()
    assert clean.recoveries == 0
    torch.testing.assert_close(
        torch.tensor(faulty.losses, dtype=torch.float64),
        torch.tensor(clean.losses, dtype=torch.float64),
        **SAME,
    )
    assert faulty.weights.keys() == clean.weights.keys()
    for key, value in clean.weights.items():
        torch.testing.assert_close(faulty.weights[key], value, **SAME, msg=key)


def pid_set(job: pipesvc.Job) -> set[int]:
    """The pids of the stages in the job's current plan."""
    return {stage_pid(s.address) for s in job.refresh().plan}


def test_cases_cover_the_matrix() -> None:
    """The matrix keeps the dimensions the module docstring promises."""
    cases = CASES.values()
    assert {c.fault.split(":")[0] for c in cases} == {"forward", "backward", "commit", "checkpoint"}
    assert {c.schedule for c in cases} == {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b"}
    assert {c.shm for c in cases} == {True, False}
    assert any(c.num_microbatches > SEND_QUEUE_ITEMS for c in cases)
    assert any(c.problem.model == "cnn" for c in cases)  # Flatten has no parameters
    assert any(c.optimizer["name"] == "adamw" and c.clip_grad_norm for c in cases)
    assert any(c.problem.model_args.get("dropout", 0) > 0 for c in cases)
    assert all(c.steps >= 2 * c.checkpoint_every + 1 for c in cases)
    assert {c.data_parallel for c in cases} == {1, 2}
    # The cells run through job.train too span the same phases, schedules, paths and replicas.
    streamed = [CASES[name] for name, via in RUNS if via == "train"]
    assert {c.fault.split(":")[0] for c in streamed} == {
        "forward",
        "backward",
        "commit",
        "checkpoint",
    }
    assert {c.schedule for c in streamed} == {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b"}
    assert {c.shm for c in streamed} == {True, False}
    assert {c.data_parallel for c in streamed} == {1, 2}
    assert any(c.clip_grad_norm for c in streamed)
    assert any(c.problem is BIG_CNN for c in streamed)
