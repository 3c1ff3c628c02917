"""Faults in a replicated job (data parallel x pipeline) cost no committed work: a stage of one
replica killed in every phase is replaced by a spare, or its replica dropped when the job allows
fewer replicas, and the groups re-form; a restarted coordinator's new store re-forms them too,
on a fixed store port as on a random one.

Every test trains against the one-process oracle on the whole batch (each step cut into
replicas x micro-batches), so a recovery that lost, repeated or reordered a step, or summed a
gradient twice or not at all, fails.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pipesvc
from pipesvc.v1 import common_pb2
from tests.support.faults import FAULT_TOL, free_port
from tests.support.reference import PROBLEMS, Reference
from tests.support.stage_probe import stage_state

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]

PROBLEM = PROBLEMS["gpt"]
ADAMW = {"name": "adamw", "lr": 1e-2}
NUM_MICROBATCHES = 3  # per replica


@pytest.fixture
def marker(tmp_path: Path) -> str:
    return str(tmp_path / "fault-fired")


class ReplicatedRun:
    """A 2 x 2 job trained step by step next to the whole model in one process."""

    def __init__(self, client: pipesvc.Client, **kw: object) -> None:
        self.job = client.create_job(
            model=PROBLEM.model,
            model_args=PROBLEM.model_args,
            seed=13,
            num_stages=2,
            data_parallel=2,
            num_microbatches=NUM_MICROBATCHES,
            schedule="1f1b",
            optimizer=ADAMW,
            loss=PROBLEM.loss,
            clip_grad_norm=1.0,
            checkpoint_every=2,
            **kw,  # type: ignore[arg-type]
        )
        self.reference = Reference(PROBLEM, seed=13, optimizer=ADAMW, clip_grad_norm=1.0)
        self.steps = 0

    def step(self) -> None:
        x, y = PROBLEM.batch(12 + self.steps % 3, seed=self.steps)
        self.steps += 1
        loss = self.job.train_step(x, y)
        expected = self.reference.step(x, y, num_microbatches=2 * NUM_MICROBATCHES)
        assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6)

    def check(self) -> None:
        weights = self.job.state_dict()
        for key, value in self.reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **FAULT_TOL, msg=key)
        by_rank: dict[int, list[dict[str, torch.Tensor]]] = {}
        for stage in self.job.refresh().plan:
            state = stage_state(stage.address, self.job.id, common_pb2.CHECKPOINT)
            by_rank.setdefault(stage.rank, []).append(state)
        for states in by_rank.values():
            for other in states[1:]:
                for key, value in states[0].items():
                    torch.testing.assert_close(other[key], value, rtol=0, atol=0, msg=key)


@contextlib.contextmanager
def _client_with_fault(fault: str, position: int, spares: int) -> Iterator[pipesvc.Client]:
    """Four stages in registration order (replica 0 ranks 0-1, replica 1 ranks 0-1), the one
    at ``position`` carrying ``fault``, then ``spares`` more."""
    with pipesvc.LocalCluster(num_stages=position, threads_per_stage=1) as cluster:
        cluster.add_stage(["--fault-kill", fault])
        for _ in range(4 - position - 1 + spares):
            cluster.add_stage()
        with cluster.connect() as client:
            yield client


@pytest.mark.parametrize(
    ("when", "step", "position"),
    [
        ("forward", 3, 3),  # replica 1's last stage
        ("backward", 4, 2),  # replica 1's first stage, nothing checkpointed since step 2
        ("commit", 3, 3),  # the other stages may have committed: all or none still holds
        ("checkpoint", 4, 1),  # replica 0's last stage while its snapshot streams
    ],
)
def test_a_killed_stage_of_one_replica_is_replaced_by_a_spare(
    marker: str, when: str, step: int, position: int
) -> None:
    rank = position % 2
    with _client_with_fault(f"{when}:{step}:{rank}:{marker}", position, spares=1) as client:
        run = ReplicatedRun(client)
        before = run.job.plan[position].address
        for _ in range(7):
            run.step()
        assert os.path.exists(marker), "the fault never fired"
        job = run.job.refresh()
        assert job.recoveries == 1
        assert [(s.replica, s.rank) for s in job.plan] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert job.plan[position].address != before
        run.check()


def test_without_a_spare_the_replica_is_dropped(marker: str) -> None:
    with _client_with_fault(f"backward:3:0:{marker}", 2, spares=0) as client:
        run = ReplicatedRun(client, min_replicas=1)
        survivor = run.job.plan[3].address
        for _ in range(6):
            run.step()
        job = run.job.refresh()
        assert job.recoveries == 1
        assert [(s.replica, s.rank) for s in job.plan] == [(0, 0), (0, 1)]
        run.check()
        freed = {s.address: s.job_id for s in client.stages()}
        assert freed[survivor] == "", "the dropped replica's survivor went back to the pool"


def test_below_min_replicas_the_step_fails_with_the_reason(marker: str) -> None:
    with _client_with_fault(f"forward:2:1:{marker}", 3, spares=0) as client:
        run = ReplicatedRun(client)
        run.step()
        x, y = PROBLEM.batch(12, seed=1)
        with pytest.raises(pipesvc.PlanError, match=r"below min_replicas \(2\)"):
            run.job.train_step(x, y)


@pytest.mark.parametrize("store_port", ["any", "fixed"])
def test_groups_reform_after_a_coordinator_restart(store_port: str) -> None:
    # A fixed --store-port (what docs/deploy.md recommends) gives the restarted coordinator's
    # store the address of the old one: the stages must still see it is a new store.
    args = ["--store-port", str(free_port())] if store_port == "fixed" else []
    with pipesvc.LocalCluster(num_stages=4, threads_per_stage=1, coordinator_args=args) as cluster:
        client = cluster.connect()
        run = ReplicatedRun(client)
        for _ in range(3):
            run.step()
        job_id = run.job.id
        run.job.refresh()  # the commit is flushed: the restarted coordinator keeps the plan epoch
        client.close()
        cluster.restart_coordinator(kill=True)
        with cluster.connect() as client:
            run.job = client.get_job(job_id)
            assert run.job.step == 3
            for _ in range(3):
                run.step()
            run.check()
            assert run.job.refresh().recoveries == 0  # the stages kept their state
