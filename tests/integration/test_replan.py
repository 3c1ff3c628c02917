"""Moving a running job's layers between steps: training goes on exactly like one process,
and the throughput plan moves work off a stage whose CPU is capped."""

from __future__ import annotations

import pytest
import torch

import pipesvc
from pipesvc.core.settle import PROBE_STEPS, REBALANCE_EVERY
from tests.support.cpu_cap import CPU_ROOT, cpu_capped
from tests.support.reference import DROPOUT_GPT, Reference
from tests.support.stage_probe import stage_info

OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
WEIGHT_TOL = {"rtol": 1e-4, "atol": 1e-5}
NUM_MICROBATCHES = 4


def _work(plan: list[pipesvc.PipelineStage], args: dict[str, int]) -> dict[str, int]:
    """Each stage's share of the ``mlp``'s multiply-adds per row (its weights' sizes)."""
    widths = [args["in_features"]] + [args["hidden_features"]] * (args["num_layers"] - 1)
    sizes = [a * b for a, b in zip(widths, [*widths[1:], args["out_features"]], strict=True)]
    return {s.address: sum(sizes[s.start_layer : s.end_layer]) for s in plan}


def _check_weights(job: pipesvc.Job, reference: Reference) -> None:
    weights = job.state_dict()
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(
            weights[key], value, **WEIGHT_TOL, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replanned_job_trains_like_one_process(client: pipesvc.Client, schedule: str) -> None:
    """A gpt with dropout and AdamW on 3 stages moves from equal layer counts to balanced
    parameters, then to the measured throughput plan, between steps; every step's loss and
    the weights after it equal one process's."""
    problem = DROPOUT_GPT
    reference = Reference(problem, seed=5, optimizer=OPTIMIZER, clip_grad_norm=None)
    with client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=5,
        num_stages=3,
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        optimizer=OPTIMIZER,
        loss=problem.loss,
        partition="uniform",
    ) as job:
        before = [(s.start_layer, s.end_layer) for s in job.plan]
        plans = [before]
        for step in range(6):
            x, y = problem.batch(8, seed=step)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y, NUM_MICROBATCHES), rel=1e-5)
            if step == 1:
                moved = job.replan("parameters")
                assert moved.moved and moved.plan == job.plan
                assert job.config.partition == "parameters"
                assert moved.current_s == [] and moved.predicted_s == []
                plans.append([(s.start_layer, s.end_layer) for s in job.plan])
            if step == 3:
                measured = job.replan("throughput")
                assert len(measured.current_s) == 3 and len(measured.predicted_s) == 3
                assert max(measured.predicted_s) <= max(measured.current_s)
                plans.append([(s.start_layer, s.end_layer) for s in job.plan])
        assert plans[0] != plans[1], plans
        _check_weights(job, reference)
        job.refresh()
        assert job.step == 6 and [(s.start_layer, s.end_layer) for s in job.plan] == plans[-1]


def test_replan_refuses_an_unknown_method_and_a_throughput_plan_before_any_step(
    client: pipesvc.Client,
) -> None:
    problem = DROPOUT_GPT
    with client.create_job(
        model=problem.model, model_args=problem.model_args, num_stages=2, loss=problem.loss
    ) as job:
        plan = job.plan
        with pytest.raises(pipesvc.InvalidArgumentError, match="'fastest'"):
            job.replan("fastest")
        with pytest.raises(pipesvc.FailedPreconditionError, match="no timings on its stage yet"):
            job.replan("throughput")
        assert job.plan == plan and job.refresh().plan == plan


@pytest.mark.skipif(not CPU_ROOT.is_dir(), reason="needs the cgroup v1 cpu controller")
def test_throughput_moves_work_off_a_capped_stage() -> None:
    """Four stages, one capped at a quarter of a CPU: a ``throughput`` job starts balanced by
    parameters, measures after its probe steps and gives the capped stage less work."""
    args = {"in_features": 256, "hidden_features": 1024, "num_layers": 12, "out_features": 8}
    with (
        pipesvc.LocalCluster(num_stages=4, threads_per_stage=1) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="mlp",
            model_args=args,
            num_stages=4,
            num_microbatches=4,
            partition="throughput",
            loss="mse",
            optimizer={"name": "sgd", "lr": 0.01},
        ) as job,
    ):
        first = _work(job.plan, args)
        slow = job.plan[1].address
        with cpu_capped(stage_info(slow).pid, 0.25):
            for step in range(PROBE_STEPS):
                x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step))
                job.train_step(x, torch.zeros(64, 8))
            after = _work(job.refresh().plan, args)
        assert after.get(slow, 0) < first[slow], (first, after)


@pytest.mark.skipif(not CPU_ROOT.is_dir(), reason="needs the cgroup v1 cpu controller")
def test_throughput_replan_trades_a_capped_stage_for_a_free_one() -> None:
    """Two stages of three train; the second is capped at a tenth of a CPU. A throughput
    replan calibrates the free stage, moves the capped stage's layers there with their
    optimizer state, and gives the capped stage back to the free pool; training then goes on
    exactly as it would have."""
    args = {"in_features": 64, "hidden_features": 512, "num_layers": 6, "out_features": 4}
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(32, 64, generator=g), torch.randn(32, 4, generator=g)) for _ in range(5)
    ]
    options = {
        "model": "mlp",
        "model_args": args,
        "num_stages": 2,
        "num_microbatches": 4,
        "loss": "mse",
        "optimizer": {"name": "adam", "lr": 1e-3},
        "partition": "uniform",
    }
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1) as cluster,
        cluster.connect() as client,
    ):
        with client.create_job(**options) as job:  # type: ignore[arg-type]
            for x, y in batches:
                job.train_step(x, y)
            expected = job.state_dict()
        with client.create_job(**options) as job:  # type: ignore[arg-type]
            capped = job.plan[1].address
            (spare,) = {s.address for s in client.stages()} - {s.address for s in job.plan}
            with cpu_capped(stage_info(capped).pid, 0.1):
                for x, y in batches[:3]:
                    job.train_step(x, y)
                moved = job.replan("throughput")
            assert moved.moved and capped not in {s.address for s in moved.plan}
            assert spare in {s.address for s in moved.plan}
            assert max(moved.predicted_s) < max(moved.current_s)
            free = {s.address for s in client.stages() if not s.job_id}
            assert free == {capped}
            for x, y in batches[3:]:
                job.train_step(x, y)
            got = job.state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.skipif(not CPU_ROOT.is_dir(), reason="needs the cgroup v1 cpu controller")
def test_rebalance_moves_work_off_a_stage_that_slows_down_while_training() -> None:
    """A ``parameters`` job with ``rebalance=True`` trains on even stages; one of them is then
    capped at a fifth of a CPU, and at the next periodic measurement the job moves layers
    off it by itself."""
    args = {"in_features": 256, "hidden_features": 1024, "num_layers": 12, "out_features": 8}
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="mlp",
            model_args=args,
            num_stages=3,
            num_microbatches=4,
            loss="mse",
            optimizer={"name": "sgd", "lr": 0.01},
            rebalance=True,
        ) as job,
    ):
        x, y = torch.randn(64, 256), torch.zeros(64, 8)
        first = _work(job.plan, args)
        slow = job.plan[1].address
        for _ in range(REBALANCE_EVERY // 2):
            job.train_step(x, y)
        with cpu_capped(stage_info(slow).pid, 0.2):
            for _ in range(REBALANCE_EVERY // 2):
                job.train_step(x, y)
            after = _work(job.refresh().plan, args)
        assert after[slow] < first[slow], (first, after)
        assert job.step == REBALANCE_EVERY


@pytest.mark.skipif(not CPU_ROOT.is_dir(), reason="needs the cgroup v1 cpu controller")
def test_throughput_plan_settles_on_a_stable_uneven_cluster() -> None:
    """Four stages, one capped at a quarter of a CPU the whole time: a ``throughput`` job moves
    at most once in 60 steps (it moved every third step when every new plan was probed)."""
    args = {"in_features": 1024, "hidden_features": 1024, "num_layers": 8, "out_features": 8}
    with (
        pipesvc.LocalCluster(num_stages=4, threads_per_stage=1) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="mlp",
            model_args=args,
            num_stages=4,
            num_microbatches=4,
            partition="throughput",
            loss="mse",
            optimizer={"name": "sgd", "lr": 0.01},
        ) as job,
    ):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(256, 1024, generator=g), torch.randn(256, 8, generator=g)
        plans = [job.plan]
        with cpu_capped(stage_info(job.plan[1].address).pid, 0.25):
            for _ in range(60):
                job.train_step(x, y)
                plan = job.refresh().plan
                if plan != plans[-1]:
                    plans.append(plan)
        assert job.step == 60
        assert len(plans) <= 2, [
            [(s.start_layer, s.end_layer, s.address) for s in p] for p in plans
        ]


def test_a_replan_between_pipelined_steps_of_a_clipping_job(client: pipesvc.Client) -> None:
    """A gpt with dropout, AdamW and clipping streams 8 steps through ``job.train``, whose runs
    go ahead of each other's decisions with the norm summed along the links; after the third
    loss the caller moves the layers (``replan``), which takes the job between two steps: the
    run sent ahead is dropped, its commit completed, the layers move, and the stream goes on
    over the new plan with every loss and the final weights equal to one process's."""
    problem = DROPOUT_GPT
    reference = Reference(problem, seed=5, optimizer=OPTIMIZER, clip_grad_norm=0.5)
    batches = [problem.batch(8, seed=step) for step in range(8)]
    with client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=5,
        num_stages=3,
        num_microbatches=NUM_MICROBATCHES,
        schedule="1f1b",
        optimizer=OPTIMIZER,
        loss=problem.loss,
        partition="uniform",
        clip_grad_norm=0.5,
        checkpoint_every=0,
    ) as job:
        before = [(s.start_layer, s.end_layer) for s in job.plan]
        losses = []
        for number, loss in enumerate(job.train(batches), start=1):
            losses.append(loss)
            if number == 3:
                assert job.replan("parameters").moved
        after = [(s.start_layer, s.end_layer) for s in job.refresh().plan]
        assert after != before
        expected = [reference.step(x, y, NUM_MICROBATCHES) for x, y in batches]
        assert losses == pytest.approx(expected, rel=1e-5)
        assert job.step == len(batches)
        _check_weights(job, reference)
