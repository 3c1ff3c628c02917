"""``job.train``: pipelined steps over one ``Train`` stream give exactly ``train_step``'s losses
and weights, stop where asked, fail at the step that failed, and leave a consistent job when
the caller stops early (see [Note: pipelined steps] in pipesvc/coordinator/train_stream.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pipesvc
from pipesvc.wire.step_stream import TRAIN_WINDOW
from tests.support.reference import PROBLEMS, Problem, Reference

ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
NUM_MICROBATCHES = 4
MLP = PROBLEMS["mlp"]
SMALL_DROPOUT_GPT = Problem(
    "gpt",
    {
        "vocab_size": 17,
        "block_size": 8,
        "embed_dim": 16,
        "num_heads": 2,
        "num_blocks": 2,
        "dropout": 0.2,
    },
    "cross_entropy",
    (8,),
)


def _job(
    client: pipesvc.Client,
    problem: Problem,
    *,
    optimizer: dict[str, object],
    num_stages: int = 2,
    schedule: str = "1f1b",
    seed: int = 7,
    clip_grad_norm: float | None = None,
) -> pipesvc.Job:
    return client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=seed,
        num_stages=num_stages,
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        virtual_stages=2 if schedule == "interleaved-1f1b" else 1,
        optimizer=optimizer,
        loss=problem.loss,
        partition="uniform",
        checkpoint_every=0,
        clip_grad_norm=clip_grad_norm,
    )


def _batches(problem: Problem, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [problem.batch(8 + i % 3, seed=i) for i in range(count)]


def _check_weights(job: pipesvc.Job, reference: Reference) -> None:
    weights = job.state_dict()
    expected = reference.model.state_dict()
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.allclose(weights[key], value, rtol=1e-5, atol=1e-6), key


@pytest.mark.parametrize(
    ("schedule", "clip"),
    [
        ("gpipe", None),
        ("1f1b", None),
        ("1f1b", 0.5),
        ("zb-h1", 0.5),
        ("interleaved-1f1b", None),
        ("interleaved-1f1b", 0.5),
    ],
)
def test_train_equals_one_process_and_a_train_step_loop(
    client: pipesvc.Client, schedule: str, clip: float | None
) -> None:
    """A gpt with dropout and AdamW: 14 steps of ``job.train`` (far more than the window; each
    step's run sent to the stages before the step before it was decided, see [Note: steps
    ahead]) give the seeded one-process reference's losses and weights, and exactly those of
    the same steps sent one by one with ``train_step``. With clipping, the runs sent ahead
    scale by the norm the stages sum along the links, and the coordinator's scale for
    ``train_step`` is the same to the bit (see [Note: norm along the links])."""
    problem, seed = SMALL_DROPOUT_GPT, 21
    batches = _batches(problem, 14)
    reference = Reference(problem, seed=seed, optimizer=ADAMW, clip_grad_norm=clip)
    expected = [reference.step(x, y, NUM_MICROBATCHES) for x, y in batches]
    jobs = [
        _job(client, problem, optimizer=ADAMW, schedule=schedule, seed=seed, clip_grad_norm=clip)
        for _ in range(2)
    ]
    with jobs[0] as streamed, jobs[1] as stepped:
        losses = list(streamed.train(batches))
        assert streamed.step == len(batches) == streamed.refresh().step
        one_by_one = [stepped.train_step(x, y) for x, y in batches]
        assert losses == one_by_one  # the same steps: bit for bit
        assert losses == pytest.approx(expected, rel=1e-5)
        _check_weights(streamed, reference)
        assert streamed.state_dict().keys() == stepped.state_dict().keys()
        for key, value in stepped.state_dict().items():
            assert torch.equal(streamed.state_dict()[key], value), key


def test_batches_as_mappings_a_generator_and_a_step_limit(client: pipesvc.Client) -> None:
    """``steps`` takes that many batches from an endless generator (and no more); mappings
    with ``inputs`` and ``targets`` are batches; an empty stream trains nothing."""
    taken: list[int] = []

    def endless() -> Iterator[dict[str, torch.Tensor]]:
        number = 0
        while True:
            taken.append(number)
            x, y = MLP.batch(8, seed=number)
            yield {"inputs": x, "targets": y}
            number += 1

    reference = Reference(MLP, seed=7, optimizer=SGD, clip_grad_norm=None)
    with _job(client, MLP, optimizer=SGD) as job:
        losses = list(job.train(endless(), steps=5, progress=True))
        assert taken == [0, 1, 2, 3, 4]
        expected = [reference.step(*MLP.batch(8, seed=i)) for i in range(5)]
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert list(job.train([])) == [] and list(job.train(endless(), steps=0)) == []
        assert job.refresh().step == 5
        _check_weights(job, reference)
        with pytest.raises(pipesvc.InvalidArgumentError, match="steps=-1"):
            job.train([], steps=-1)


@pytest.mark.parametrize("kind", ["not a pair", "rows differ", "wrong features"])
def test_an_invalid_batch_fails_at_its_step_and_nothing_after_runs(
    client: pipesvc.Client, kind: str
) -> None:
    """Batch 4 is malformed (caught in the client), does not split (caught by the
    coordinator) or does not fit the model (caught by a stage, its run aborted): the three
    steps before it are committed and yielded, the error is raised at step 4, and no later
    batch is trained."""
    batches: list[object] = list(_batches(MLP, 7))
    x, y = MLP.batch(8, seed=99)
    batches[3] = {
        "not a pair": (x, y, y),
        "rows differ": (x, y[:5]),
        "wrong features": (torch.randn(8, 5), y),
    }[kind]
    reference = Reference(MLP, seed=7, optimizer=SGD, clip_grad_norm=None)
    expected = [reference.step(*b) for b in batches[:3]]  # type: ignore[misc]
    losses: list[float] = []
    with _job(client, MLP, optimizer=SGD) as job:
        with pytest.raises(pipesvc.InvalidArgumentError):
            for loss in job.train(batches):
                losses.append(loss)
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert job.refresh().step == 3
        _check_weights(job, reference)
        x, y = MLP.batch(8, seed=50)  # the job trains on as before
        assert job.train_step(x, y) == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
        assert job.step == 4


def test_stopping_early_leaves_a_consistent_job(client: pipesvc.Client) -> None:
    """A caller that breaks out after 3 losses: the steps already sent finish (each whole)
    and count in ``job.step``; nothing of the stream runs later, so the next ``train_step``
    is the next step, and the weights are the reference's over exactly those steps."""
    batches = _batches(MLP, 12)
    reference = Reference(MLP, seed=7, optimizer=SGD, clip_grad_norm=None)
    with _job(client, MLP, optimizer=SGD) as job:
        for number, loss in enumerate(job.train(batches), start=1):
            assert loss == pytest.approx(reference.step(*batches[number - 1]), rel=1e-5, abs=1e-6)
            if number == 3:
                break
        committed = job.step
        assert 3 <= committed <= 3 + TRAIN_WINDOW
        assert job.refresh().step == committed
        for x, y in batches[3:committed]:
            reference.step(x, y)
        x, y = MLP.batch(8, seed=77)
        assert job.train_step(x, y) == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
        assert job.step == committed + 1
        _check_weights(job, reference)
        # A second stream after the first goes on from there.
        losses = list(job.train(batches[:4]))
        assert losses == pytest.approx(
            [reference.step(x, y) for x, y in batches[:4]], rel=1e-5, abs=1e-6
        )
        assert job.step == committed + 5
        _check_weights(job, reference)
