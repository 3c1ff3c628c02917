"""Jobs on a real cluster: placement, memory per stage, state transfer and clear errors."""

from __future__ import annotations

import contextlib

import pytest
import torch

import pipesvc
from pipesvc import models
from pipesvc.core.limits import MAX_MICROBATCHES
from pipesvc.core.schedule import max_in_flight
from tests.integration.conftest import NUM_STAGES
from tests.support.reference import PROBLEMS, Reference
from tests.support.stage_probe import stage_info

MLP = PROBLEMS["mlp"]


def _mlp_job(client: pipesvc.Client, **overrides: object) -> pipesvc.Job:
    options: dict[str, object] = {
        "model": "mlp",
        "model_args": MLP.model_args,
        "num_stages": 3,
        "num_microbatches": 4,
        "loss": "mse",
        "optimizer": {"name": "sgd", "lr": 0.1},
    }
    options.update(overrides)
    return client.create_job(**options)  # type: ignore[arg-type]


def test_each_stage_holds_only_its_layers(client: pipesvc.Client) -> None:
    problem = PROBLEMS["gpt"]
    with client.create_job(
        model="gpt", model_args=problem.model_args, num_stages=NUM_STAGES, num_microbatches=2
    ) as job:
        full = models.build("gpt", **problem.model_args)
        total = 0
        for stage in job.plan:
            info = stage_info(stage.address)
            assert info.job_id == job.id
            assert (info.start_layer, info.end_layer, info.rank) == (
                stage.start_layer,
                stage.end_layer,
                stage.rank,
            )
            layers = {int(name.split(".")[0]) for name in info.parameter_names}
            assert layers <= set(range(stage.start_layer, stage.end_layer))
            expected = sum(
                p.numel()
                for i in range(stage.start_layer, stage.end_layer)
                for p in full[i].parameters()
            )
            assert info.num_parameters == expected
            total += info.num_parameters
        assert total == sum(p.numel() for p in full.parameters())
    for stage in job.plan:
        assert stage_info(stage.address).job_id == ""


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_schedule_bounds_live_activations(client: pipesvc.Client, schedule: str) -> None:
    """Each stage held as many micro-batches' activations at once as its schedule says."""
    num_microbatches = 8
    with _mlp_job(
        client, num_stages=NUM_STAGES, num_microbatches=num_microbatches, schedule=schedule
    ) as job:
        x, y = MLP.batch(16, seed=0)
        job.train_step(x, y)
        for stage in job.plan:
            live = stage_info(stage.address).peak_in_flight
            expected = max_in_flight(
                schedule,
                rank=stage.rank,
                num_stages=NUM_STAGES,
                num_microbatches=num_microbatches,
            )
            assert live == expected
            if schedule == "1f1b":
                assert live == min(NUM_STAGES - stage.rank, num_microbatches)
            elif schedule == "gpipe":
                assert live == num_microbatches


def test_the_largest_allowed_number_of_microbatches_trains(client: pipesvc.Client) -> None:
    # One row per micro-batch, GPipe (rank 0 runs every forward before any backward, so the
    # most mail waits at rank 1): the step equals one-process training.
    optimizer = {"name": "sgd", "lr": 0.1}
    reference = Reference(MLP, seed=0, optimizer=optimizer, clip_grad_norm=None)
    with _mlp_job(
        client,
        num_stages=2,
        num_microbatches=MAX_MICROBATCHES,
        schedule="gpipe",
        optimizer=optimizer,
        checkpoint_every=0,
    ) as job:
        x, y = MLP.batch(MAX_MICROBATCHES, seed=3)
        loss = job.train_step(x, y)
        assert loss == pytest.approx(reference.step(x, y), rel=1e-5)
        weights = job.state_dict()
        for name, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5)
        assert job.step == 1


def test_state_dict_round_trip(client: pipesvc.Client) -> None:
    with _mlp_job(client) as job:
        other = models.build("mlp", seed=7, **MLP.model_args)
        job.load_state_dict(other.state_dict())
        loaded = job.state_dict()
        assert loaded.keys() == other.state_dict().keys()
        for key, value in other.state_dict().items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
        x, _ = MLP.batch(6, seed=1)
        with torch.no_grad():
            torch.testing.assert_close(job.forward(x), other(x))


def test_bad_state_dict_changes_nothing(client: pipesvc.Client) -> None:
    with _mlp_job(client) as job:
        before = job.state_dict()
        replacement = models.build("mlp", seed=9, **MLP.model_args).state_dict()
        missing = dict(replacement)
        missing.pop("3.bias")
        with pytest.raises(pipesvc.InvalidArgumentError, match=r"missing.*3\.bias"):
            job.load_state_dict(missing)
        first = next(iter(replacement))
        wrong_shape = dict(replacement)
        wrong_shape[first] = torch.zeros(2, 2)
        with pytest.raises(pipesvc.InvalidArgumentError, match=rf"{first}.*shape"):
            job.load_state_dict(wrong_shape)
        unknown = dict(replacement)
        unknown["9.weight"] = torch.zeros(1)
        with pytest.raises(pipesvc.InvalidArgumentError, match=r"9\.weight"):
            job.load_state_dict(unknown)
        after = job.state_dict()
        for key, value in before.items():
            assert torch.equal(after[key], value), key


def test_bad_batch_changes_nothing_and_the_job_still_trains(client: pipesvc.Client) -> None:
    with _mlp_job(client) as job:
        before = job.state_dict()
        x, y = MLP.batch(8, seed=0)
        with pytest.raises(pipesvc.InvalidArgumentError, match=r"layer 0 failed.*\[2, 5\]"):
            job.train_step(torch.randn(8, 5), y)
        with pytest.raises(pipesvc.InvalidArgumentError, match=r"batch size \(2\).*\(4\)"):
            job.train_step(x[:2], y[:2])
        with pytest.raises(pipesvc.InvalidArgumentError, match="same batch size"):
            job.train_step(x, y[:7])
        with pytest.raises(pipesvc.InvalidArgumentError, match="mse target shape"):
            job.train_step(x, torch.randn(8, 4))
        after = job.state_dict()
        for key, value in before.items():
            assert torch.equal(after[key], value), key
        assert job.step == 0
        job.train_step(x, y)
        assert job.step == 1


def test_a_wrong_input_width_names_the_batch_the_caller_sent(client: pipesvc.Client) -> None:
    with _mlp_job(client) as job:
        _, y = MLP.batch(8, seed=0)
        with pytest.raises(pipesvc.InvalidArgumentError) as info:
            job.train_step(torch.randn(8, 5), y)
        message = str(info.value)
        assert message.startswith("inputs of shape [8, 5] and targets of shape [8, 3]"), message
        assert "4 micro-batches of 2 rows" in message
        with pytest.raises(pipesvc.InvalidArgumentError, match=r"^inputs of shape \[6, 5\],"):
            job.forward(torch.randn(6, 5))
        with pytest.raises(pipesvc.InvalidArgumentError) as info:  # names the batch already
            job.train_step(torch.randn(8, 6), y[:7])
        assert str(info.value).startswith("inputs [8, 6] and targets [7, 3]"), info.value
        assert job.step == 0


def test_no_free_stage_says_which_jobs_hold_them_and_how_to_free_them(
    client: pipesvc.Client,
) -> None:
    holder = _mlp_job(client, num_stages=NUM_STAGES)
    try:
        assert [j.id for j in client.jobs()] == [holder.id]
        with pytest.raises(pipesvc.PlanError) as info:
            _mlp_job(client, num_stages=2)
        message = str(info.value)
        assert holder.id in message
        assert "client.jobs()" in message and "client.get_job(job_id).close()" in message
        for job in client.jobs():  # what the message suggests
            job.close()
        assert client.jobs() == []
        with _mlp_job(client, num_stages=2) as again:
            assert [j.id for j in client.jobs()] == [again.id]
    finally:
        with contextlib.suppress(pipesvc.NotFoundError):  # closed above unless a check failed
            holder.close()


def test_job_repr_names_id_model_plan_and_step(client: pipesvc.Client) -> None:
    with _mlp_job(client, num_stages=2) as job:
        text = repr(job)
        assert text.startswith(f"Job(id={job.id!r}, model='mlp', step=0,")
        for stage in job.plan:
            assert f"[{stage.start_layer}, {stage.end_layer}) at {stage.address}" in text
        job.train_step(*MLP.batch(8, seed=0))
        assert "step=1," in repr(job)


def test_unknown_model_lists_the_known_ones(client: pipesvc.Client) -> None:
    with pytest.raises(pipesvc.UnknownModelError, match=r"'resnet'.*cnn, gpt, mlp"):
        client.create_job(model="resnet", num_stages=2)


@pytest.mark.parametrize("name", ["os.path", "../models/x", "pipesvc.models.gpt", "/tmp/m.py"])
def test_module_and_path_names_are_refused(client: pipesvc.Client, name: str) -> None:
    with pytest.raises(pipesvc.InvalidArgumentError, match="not a model name"):
        client.create_job(model=name, num_stages=2)


def test_plan_errors_name_the_numbers(client: pipesvc.Client) -> None:
    with pytest.raises(pipesvc.InvalidArgumentError, match=r"num_stages \(5\).*\(4\)"):
        _mlp_job(client, num_stages=5)
    big = {**MLP.model_args, "num_layers": 8}
    with pytest.raises(pipesvc.PlanError, match=rf"num_stages \(6\).*\({NUM_STAGES}"):
        _mlp_job(client, num_stages=6, model_args=big)
    with pytest.raises(pipesvc.InvalidArgumentError, match="hidden_size"):
        _mlp_job(client, model_args={"hidden_size": 3})
    # Nothing was left claimed by the failed attempts.
    assert all(not s.job_id for s in client.stages())


def test_missing_job_is_not_found(client: pipesvc.Client) -> None:
    with pytest.raises(pipesvc.NotFoundError, match="nope"):
        client.get_job("nope")


def test_get_job_and_stage_table(client: pipesvc.Client) -> None:
    with _mlp_job(client, num_stages=2) as job:
        same = client.get_job(job.id)
        assert same.plan == job.plan
        assert same.config == job.config
        table = {s.address: s for s in client.stages()}
        assert len(table) == NUM_STAGES
        assert all(s.health == "SERVING" for s in table.values())
        for stage in job.plan:
            row = table[stage.address]
            assert (row.job_id, row.rank, row.start_layer, row.end_layer) == (
                job.id,
                stage.rank,
                stage.start_layer,
                stage.end_layer,
            )
