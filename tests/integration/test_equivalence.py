"""The contract: a pipelined job trains exactly like the whole model in one process."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

import pipesvc
from pipesvc.v1 import stage_pb2
from tests.support.reference import PROBLEMS, Reference
from tests.support.stage_probe import stage_info

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
WEIGHT_TOL = {"rtol": 1e-4, "atol": 1e-5}
OPTIMIZER_CYCLE = [
    {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
    {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    {"name": "adam", "lr": 1e-2, "betas": [0.8, 0.95]},
]
CASES = [
    (model, schedule, num_stages)
    for model, schedule, num_stages in itertools.product(
        sorted(PROBLEMS), ("gpipe", "1f1b", "zb-h1"), (2, 3, 4)
    )
]
# Even, uneven (7 = 2+2+2+1) and uneven-the-other-way (9) batches over 4 micro-batches.
BATCH_SIZES = (8, 7, 9)
NUM_MICROBATCHES = 4
# Every job checkpoints every 2 steps; cnn (its Flatten layer has no parameters) trains past
# two periodic checkpoints.
CHECKPOINT_EVERY = 2
LONG_RUN_MODELS = {"cnn": (*BATCH_SIZES, 8, 7)}


@pytest.mark.parametrize(("model", "schedule", "num_stages"), CASES)
def test_training_matches_one_process(
    client: pipesvc.Client, model: str, schedule: str, num_stages: int
) -> None:
    """On the shared cluster every link uses shared memory (all stages are on this host)."""
    infos = _check_training(client, model, schedule, num_stages)
    assert len(infos) == num_stages
    assert all(i.downstream_shm for i in infos if i.rank < num_stages - 1), infos
    assert all(i.upstream_shm for i in infos if i.rank > 0), infos


@dataclass(frozen=True)
class MixedCluster:
    client: pipesvc.Client
    frame_only_pids: frozenset[int]
    """Stages started with ``--shm-bytes 0``: shared memory is off both ways for them (they
    offer no area and refuse a neighbour's), so both directions of their links are frames."""


@pytest.fixture(scope="module")
def mixed() -> Iterator[MixedCluster]:
    """Four stages, two with shared memory off: a link between two stages with it on uses
    shared memory both ways, any link touching one with it off uses frames both ways, so a job
    over any 3 or 4 of them has both kinds of link side by side."""
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster:
        frame_only = {cluster.add_stage(["--shm-bytes", "0"]) for _ in range(2)}
        with pipesvc.connect(cluster.address, timeout_s=120) as connected:
            yield MixedCluster(connected, frozenset(frame_only))


def _infos(client: pipesvc.Client) -> list[stage_pb2.StageInfo]:
    return [stage_info(s.address) for s in client.stages()]


@pytest.mark.parametrize(
    ("model", "schedule", "num_stages"),
    [("mlp", "1f1b", 4), ("gpt", "gpipe", 4), ("cnn", "1f1b", 3)],
)
def test_training_matches_one_process_on_mixed_paths(
    mixed: MixedCluster, model: str, schedule: str, num_stages: int
) -> None:
    """Each link took the path both its ends allow: shared memory, both ways, exactly when
    both stages have it on, frames otherwise; and the job has links of both kinds."""
    infos = sorted(_check_training(mixed.client, model, schedule, num_stages), key=_rank)
    assert [i.rank for i in infos] == list(range(num_stages))
    on = [i.pid not in mixed.frame_only_pids for i in infos]
    links = [on[r] and on[r + 1] for r in range(num_stages - 1)]  # shared memory on link r
    paths = [(i.upstream_shm, i.downstream_shm) for i in infos]
    expected = [
        (r > 0 and links[r - 1], r < num_stages - 1 and links[r]) for r in range(num_stages)
    ]
    assert paths == expected, f"(upstream_shm, downstream_shm) per rank; shm on {on}"
    assert any(links) and not all(links), f"shared memory on links {links}"


def _rank(info: stage_pb2.StageInfo) -> int:
    return int(info.rank)


def _check_training(
    client: pipesvc.Client, model: str, schedule: str, num_stages: int
) -> list[stage_pb2.StageInfo]:
    """Trains against the one-process reference; returns the job's stages' Info."""
    index = CASES.index((model, schedule, num_stages))
    problem = PROBLEMS[model]
    optimizer = OPTIMIZER_CYCLE[index % len(OPTIMIZER_CYCLE)]
    clip = 0.5 if index % 2 else None
    partition = "parameters" if index % 4 < 2 else "uniform"
    seed = 100 + index
    reference = Reference(problem, seed=seed, optimizer=optimizer, clip_grad_norm=clip)
    with client.create_job(
        model=model,
        model_args=problem.model_args,
        seed=seed,
        num_stages=num_stages,
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        optimizer=optimizer,
        loss=problem.loss,
        partition=partition,
        clip_grad_norm=clip,
        checkpoint_every=CHECKPOINT_EVERY,
    ) as job:
        assert len(job.plan) == num_stages
        initial = job.state_dict()
        expected_initial = reference.model.state_dict()
        assert initial.keys() == expected_initial.keys()
        for key, value in expected_initial.items():
            torch.testing.assert_close(initial[key], value, rtol=0, atol=0)

        batch_sizes = LONG_RUN_MODELS.get(model, BATCH_SIZES)
        for step, batch_size in enumerate(batch_sizes):
            x, y = problem.batch(batch_size, seed=step)
            expected_grads = reference.accumulated_gradients(x, y, NUM_MICROBATCHES)
            loss = job.train_step(x, y)
            expected_loss = reference.step(x, y)
            assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
            grads = job.gradients()
            assert grads.keys() == expected_grads.keys()
            for key, value in expected_grads.items():
                torch.testing.assert_close(
                    grads[key], value, **GRAD_TOL, msg=lambda m, k=key: f"{k}: {m}"
                )
            weights = job.state_dict()
            for key, value in reference.model.state_dict().items():
                torch.testing.assert_close(
                    weights[key], value, **WEIGHT_TOL, msg=lambda m, k=key: f"{k}: {m}"
                )
        assert job.step == len(batch_sizes)

        x, _ = problem.batch(5, seed=99)
        with torch.no_grad():
            expected_out = reference.model(x)
        torch.testing.assert_close(job.forward(x), expected_out, **WEIGHT_TOL)
        return [info for info in _infos(client) if info.job_id == job.id]
