"""Virtual stages (``schedule="interleaved-1f1b"``, ``virtual_stages=V``): every stage holds V
layer ranges, activations go round the stages V times, and training still equals the whole
model in one process (see [Note: virtual stages] in pipesvc.core.schedule). On the shared
four-stage cluster (``client`` in conftest.py)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.reference import PROBLEMS, Problem, Reference
from tests.support.stage_probe import stage_info

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
WEIGHT_TOL = {"rtol": 1e-4, "atol": 1e-5}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
NUM_MICROBATCHES = 4
# Models with enough layers for 3 stages x 3 chunks (mlp), 3 x 2 (gpt) and 2 x 2 (cnn).
MLP12 = dataclasses.replace(
    PROBLEMS["mlp"], model_args={**PROBLEMS["mlp"].model_args, "num_layers": 12}
)
GPT6 = dataclasses.replace(
    PROBLEMS["gpt"], model_args={**PROBLEMS["gpt"].model_args, "num_blocks": 4}
)
GPT6_DROPOUT = dataclasses.replace(GPT6, model_args={**GPT6.model_args, "dropout": 0.2})
CNN = PROBLEMS["cnn"]
CASES = [
    ("mlp", 2, 2),
    ("mlp", 2, 3),
    ("mlp", 3, 2),
    ("mlp", 3, 3),
    ("gpt", 2, 2),
    ("gpt", 2, 3),
    ("gpt", 3, 2),
    ("cnn", 2, 2),
]
MODELS = {"mlp": MLP12, "gpt": GPT6, "cnn": CNN}
BATCH_SIZES = (8, 9, 7)  # even and uneven micro-batches


def _create(
    client: pipesvc.Client,
    problem: Problem,
    stages: int,
    chunks: int,
    *,
    optimizer: dict[str, object] = SGD,
    clip: float | None = None,
    seed: int = 7,
    **kw: object,
) -> pipesvc.Job:
    return client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=seed,
        num_stages=stages,
        virtual_stages=chunks,
        schedule="interleaved-1f1b",
        num_microbatches=NUM_MICROBATCHES,
        optimizer=optimizer,
        loss=problem.loss,
        clip_grad_norm=clip,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("model", "stages", "chunks"), CASES)
def test_virtual_stages_train_like_one_process(
    client: pipesvc.Client, model: str, stages: int, chunks: int
) -> None:
    index = CASES.index((model, stages, chunks))
    problem = MODELS[model]
    optimizer = (SGD, ADAMW)[index % 2]
    clip = 0.5 if index % 3 == 0 else None
    partition = ("parameters", "uniform")[index % 2]
    reference = Reference(problem, seed=7, optimizer=optimizer, clip_grad_norm=clip)
    with _create(
        client,
        problem,
        stages,
        chunks,
        optimizer=optimizer,
        clip=clip,
        partition=partition,
        checkpoint_every=2,
    ) as job:
        plan = job.plan
        assert [(s.rank, s.chunk) for s in plan] == [
            (v % stages, v // stages) for v in range(stages * chunks)
        ]
        assert all(s.address == plan[s.rank].address for s in plan)
        assert [s.start_layer for s in plan[1:]] == [s.end_layer for s in plan[:-1]]
        for step, batch_size in enumerate(BATCH_SIZES):
            x, y = problem.batch(batch_size, seed=step)
            expected_grads = reference.accumulated_gradients(x, y, NUM_MICROBATCHES)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
            grads = job.gradients()
            assert grads.keys() == expected_grads.keys()
            for key, value in expected_grads.items():
                torch.testing.assert_close(grads[key], value, **GRAD_TOL, msg=key)
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **WEIGHT_TOL, msg=key)
        x, _ = problem.batch(5, seed=99)
        with torch.no_grad():
            torch.testing.assert_close(job.forward(x), reference.model(x), **WEIGHT_TOL)
        # The checkpoint of step 2 streams in the background: it shows once it is on disk.
        deadline = time.monotonic() + 60
        while job.refresh().checkpoint_step != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.checkpoint_step == 2
        infos = [stage_info(s.address) for s in plan if s.chunk == 0]
        assert [(i.rank, i.step) for i in infos] == [(r, len(BATCH_SIZES)) for r in range(stages)]


def test_dropout_and_replicas_with_virtual_stages(client: pipesvc.Client) -> None:
    """Masks are drawn per (step, micro-batch, layer) wherever a layer runs; with replicas,
    each replica's stages hold their chunks and sum their gradients as one."""
    reference = Reference(GPT6_DROPOUT, seed=9, optimizer=ADAMW, clip_grad_norm=1.0)
    with _create(
        client, GPT6_DROPOUT, 2, 2, optimizer=ADAMW, clip=1.0, seed=9, data_parallel=2
    ) as job:
        assert [(s.replica, s.rank, s.chunk) for s in job.plan] == [
            (r, v % 2, v // 2) for r in range(2) for v in range(4)
        ]
        for step, batch_size in enumerate((8, 11)):
            x, y = GPT6_DROPOUT.batch(batch_size, seed=step)
            loss = job.train_step(x, y)
            expected = reference.step(x, y, num_microbatches=2 * NUM_MICROBATCHES)
            assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6)
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **WEIGHT_TOL, msg=key)


def test_a_checkpoint_of_virtual_stages_resumes_on_a_plain_plan(
    client: pipesvc.Client, tmp_path: Path
) -> None:
    reference = Reference(MLP12, seed=7, optimizer=ADAMW, clip_grad_norm=None)
    with _create(client, MLP12, 2, 3, optimizer=ADAMW) as job:
        for step in range(2):
            x, y = MLP12.batch(8, seed=step)
            job.train_step(x, y)
            reference.step(x, y)
        job.save(tmp_path / "ckpt")
    with client.create_job(
        model=MLP12.model,
        model_args=MLP12.model_args,
        num_stages=3,
        loss=MLP12.loss,
        optimizer=ADAMW,
        resume_from=tmp_path / "ckpt",
    ) as resumed:
        x, y = MLP12.batch(8, seed=2)
        loss = resumed.train_step(x, y)
        assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "1f1b", "virtual_stages": 2}, r"needs one of \['interleaved-1f1b'\]"),
        ({"num_stages": 1, "virtual_stages": 2}, r"needs num_stages >= 2"),
        ({"num_stages": 3, "virtual_stages": 3}, r"num_stages x virtual_stages \(3 x 3\)"),
        ({"virtual_stages": 2, "partition": "memory"}, "interleaved plans are cut by"),
        ({"virtual_stages": 0}, r"virtual_stages \(0\) must be at least 1"),
    ],
)
def test_bad_virtual_stage_options_are_refused(
    client: pipesvc.Client, kwargs: dict[str, object], match: str
) -> None:
    before = [(s.address, s.job_id) for s in client.stages()]
    args: dict[str, object] = {
        "num_stages": 2,
        "schedule": "interleaved-1f1b",
        "model": CNN.model,
        "model_args": CNN.model_args,
        "loss": CNN.loss,
        **kwargs,
    }
    with pytest.raises(pipesvc.InvalidArgumentError, match=match):
        client.create_job(**args)  # type: ignore[arg-type]
    assert [(s.address, s.job_id) for s in client.stages()] == before


def test_generation_is_refused_with_virtual_stages(client: pipesvc.Client) -> None:
    with (
        _create(client, GPT6, 2, 2) as job,
        pytest.raises(pipesvc.FailedPreconditionError, match="generation through virtual stages"),
    ):
        job.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
