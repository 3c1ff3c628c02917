"""Replicated pipelines (data parallel x pipeline) train exactly like one process on the whole
batch (see [Note: replicas] in pipesvc.coordinator.replicas)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pipesvc
from pipesvc.v1 import common_pb2
from tests.support.reference import DROPOUT_GPT, PROBLEMS, Problem, Reference
from tests.support.stage_probe import stage_info, stage_state

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
WEIGHT_TOL = {"rtol": 1e-4, "atol": 1e-5}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
NUM_MICROBATCHES = 2
CASES = list(itertools.product((2, 3), (2, 3), ("gpipe", "1f1b", "zb-h1")))
MODELS = ("mlp", "gpt", "cnn")
# Even and uneven shares: 13 rows over 3 x 2 micro-batches are 3, 2, 2, 2, 2, 2.
BATCH_SIZES = (12, 13, 11)


@pytest.fixture(scope="module")
def client() -> Iterator[pipesvc.Client]:
    with (
        pipesvc.LocalCluster(num_stages=9, threads_per_stage=1) as cluster,
        pipesvc.connect(cluster.address, timeout_s=120) as connected,
    ):
        yield connected


def _create(
    client: pipesvc.Client,
    problem: Problem,
    *,
    replicas: int,
    stages: int,
    schedule: str = "1f1b",
    optimizer: dict[str, object] = SGD,
    clip: float | None = None,
    seed: int = 5,
    **kw: object,
) -> pipesvc.Job:
    return client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=seed,
        num_stages=stages,
        data_parallel=replicas,
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        optimizer=optimizer,
        loss=problem.loss,
        clip_grad_norm=clip,
        **kw,  # type: ignore[arg-type]
    )


def _check_replicas_agree(job: pipesvc.Job) -> None:
    """Every replica's stages hold the same weights and optimizer state as replica 0's."""
    by_rank: dict[int, list[dict[str, torch.Tensor]]] = {}
    for stage in job.plan:
        state = stage_state(stage.address, job.id, common_pb2.CHECKPOINT)
        by_rank.setdefault(stage.rank, []).append(state)
    for rank, states in by_rank.items():
        for other in states[1:]:
            assert other.keys() == states[0].keys()
            for key, value in states[0].items():
                torch.testing.assert_close(other[key], value, rtol=0, atol=0, msg=f"{rank} {key}")


@pytest.mark.parametrize(("replicas", "clip"), [(2, None), (3, 0.05)])
def test_replicas_train_like_one_process_through_job_train(
    client: pipesvc.Client, replicas: int, clip: float | None
) -> None:
    """``job.train``'s steps go ahead of each other's decisions on every replica's stages
    (see [Note: steps ahead]); with checkpoints every third step (whose commits do not go
    ahead) they give the one-process losses and weights, and the replicas agree to the bit.
    With clipping on 3 replicas the runs do not go ahead and every replica applies the
    coordinator's one scale (see [Note: norm along the links])."""
    problem = PROBLEMS["mlp"]
    reference = Reference(problem, seed=5, optimizer=SGD, clip_grad_norm=clip)
    batches = [problem.batch(size, seed=step) for step, size in enumerate(BATCH_SIZES * 2)]
    with _create(
        client, problem, replicas=replicas, stages=2, clip=clip, checkpoint_every=3
    ) as job:
        losses = list(job.train(batches))
        assert losses == pytest.approx([reference.step(x, y) for x, y in batches], rel=1e-5)
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **WEIGHT_TOL, msg=key)
        _check_replicas_agree(job)
        assert job.refresh().checkpoint_step == 3 * (len(batches) // 3)


@pytest.mark.parametrize(("replicas", "stages", "schedule"), CASES)
def test_replicas_train_like_one_process(
    client: pipesvc.Client, replicas: int, stages: int, schedule: str
) -> None:
    index = CASES.index((replicas, stages, schedule))
    problem = PROBLEMS[MODELS[index % len(MODELS)]]
    optimizer = (SGD, ADAMW)[index % 2]
    clip = 0.5 if index % 4 >= 2 else None
    reference = Reference(problem, seed=5, optimizer=optimizer, clip_grad_norm=clip)
    with _create(
        client,
        problem,
        replicas=replicas,
        stages=stages,
        schedule=schedule,
        optimizer=optimizer,
        clip=clip,
        checkpoint_every=2,
    ) as job:
        plan = job.plan
        assert [(s.replica, s.rank) for s in plan] == [
            (r, k) for r in range(replicas) for k in range(stages)
        ]
        assert len({s.address for s in plan}) == replicas * stages
        assert {(s.start_layer, s.end_layer) for s in plan if s.replica == 1} == {
            (s.start_layer, s.end_layer) for s in plan if s.replica == 0
        }
        for step, batch_size in enumerate(BATCH_SIZES):
            x, y = problem.batch(batch_size, seed=step)
            m = replicas * NUM_MICROBATCHES
            expected_grads = reference.accumulated_gradients(x, y, m)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
            grads = job.gradients()
            assert grads.keys() == expected_grads.keys()
            for key, value in expected_grads.items():
                torch.testing.assert_close(grads[key], value, **GRAD_TOL, msg=key)
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **WEIGHT_TOL, msg=key)
        _check_replicas_agree(job)
        x, _ = problem.batch(2 * replicas * NUM_MICROBATCHES + 1, seed=99)
        with torch.no_grad():
            expected_out = reference.model(x)
        torch.testing.assert_close(job.forward(x), expected_out, **WEIGHT_TOL)
        assert job.refresh().checkpoint_step == 2


def test_dropout_masks_follow_the_step_wide_microbatch(client: pipesvc.Client) -> None:
    """Each replica draws the masks of its micro-batches' indices in the whole step, so a
    gpt with dropout matches one process that accumulates over all R x M micro-batches."""
    reference = Reference(DROPOUT_GPT, seed=8, optimizer=ADAMW, clip_grad_norm=1.0)
    with _create(
        client, DROPOUT_GPT, replicas=3, stages=2, optimizer=ADAMW, clip=1.0, seed=8
    ) as job:
        for step, batch_size in enumerate((6, 7)):
            x, y = DROPOUT_GPT.batch(batch_size, seed=step)
            loss = job.train_step(x, y)
            expected = reference.step(x, y, num_microbatches=3 * NUM_MICROBATCHES)
            assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6)
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **WEIGHT_TOL, msg=key)


def test_a_failed_run_leaves_no_collective_behind(client: pipesvc.Client) -> None:
    """A run that fails on one replica only (a class index out of range in its share) is
    aborted while the other replica waits in its gradient sum; nothing changes, and the next
    step's sum must not meet the collective the aborted run left posted."""
    problem = PROBLEMS["cnn"]
    reference = Reference(problem, seed=5, optimizer=SGD, clip_grad_norm=None)
    with _create(client, problem, replicas=2, stages=2) as job:
        x, y = problem.batch(8, seed=0)
        job.train_step(x, y)
        reference.step(x, y)
        bad_x, bad_y = problem.batch(8, seed=1)
        bad_y[-1] = problem.num_classes  # only replica 1's share holds it
        with pytest.raises(pipesvc.InvalidArgumentError, match=r"cross_entropy loss failed"):
            job.train_step(bad_x, bad_y)
        assert job.refresh().step == 1
        for step in (2, 3):
            x, y = problem.batch(8, seed=step)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **WEIGHT_TOL, msg=key)
        _check_replicas_agree(job)


def test_load_and_small_batches_reach_every_replica(client: pipesvc.Client) -> None:
    """A loaded state reaches every replica (training after it matches one process started
    from it); an inference batch smaller than the replicas runs on those it reaches, after
    flushing the pending commit to all."""
    problem = PROBLEMS["mlp"]
    source = Reference(problem, seed=21, optimizer=SGD, clip_grad_norm=None)
    reference = Reference(problem, seed=5, optimizer=SGD, clip_grad_norm=None)
    reference.model.load_state_dict(source.model.state_dict())
    with _create(client, problem, replicas=3, stages=2) as job:
        job.load_state_dict(source.model.state_dict())
        _check_replicas_agree(job)
        x, y = problem.batch(12, seed=3)
        loss = job.train_step(x, y)
        assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
        one, _ = problem.batch(1, seed=4)  # reaches replica 0 only
        with torch.no_grad():
            torch.testing.assert_close(job.forward(one), reference.model(one), **WEIGHT_TOL)
        infos = [stage_info(s.address) for s in job.plan]
        assert {i.step for i in infos} == {1}, "the commit reached every replica"
        _check_replicas_agree(job)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"data_parallel": 0}, r"data_parallel \(0\)"),
        ({"data_parallel": 2, "min_replicas": 3}, r"min_replicas \(3\)"),
        ({"data_parallel": 2, "partition": "throughput"}, "re-planning a replicated job"),
        ({"data_parallel": 2, "rebalance": True}, "re-planning a replicated job"),
        ({"data_parallel": 5, "num_stages": 2}, r"num_stages x data_parallel \(2 x 5\)"),
    ],
)
def test_bad_replica_options_are_refused(
    client: pipesvc.Client, kwargs: dict[str, object], match: str
) -> None:
    before = [(s.address, s.job_id) for s in client.stages()]
    problem = PROBLEMS["mlp"]
    args: dict[str, object] = {"num_stages": 2, **kwargs}
    with pytest.raises((pipesvc.InvalidArgumentError, pipesvc.PlanError), match=match):
        client.create_job(
            model=problem.model, model_args=problem.model_args, loss=problem.loss, **args
        )  # type: ignore[arg-type]
    assert [(s.address, s.job_id) for s in client.stages()] == before


def test_the_trace_shows_every_replica_and_its_gradient_sum(
    client: pipesvc.Client, tmp_path: Path
) -> None:
    problem = PROBLEMS["mlp"]
    with _create(client, problem, replicas=2, stages=2) as job:
        for step in range(2):
            job.train_step(*problem.batch(8, seed=step))
        timelines = job.timelines(max_runs=1)
        assert [t.rank for t in timelines] == [0, 1, 2, 3]
        assert [t.address.rsplit(" ", 4)[1:] for t in timelines] == [
            ["replica", str(r), "rank", str(k)] for r in range(2) for k in range(2)
        ]
        for timeline in timelines:
            names = {e.name for e in timeline.events}
            assert {"forward", "backward", "reduce"} <= names, timeline.address
        json_path, png_path = job.trace(tmp_path / "trace")
        assert json_path.stat().st_size > 0 and png_path.stat().st_size > 0
