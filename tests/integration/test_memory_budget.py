"""Memory budgets: a model that fits no single stage trains across stages whose budgets it fits."""

from __future__ import annotations

import pytest
import torch

import pipesvc
from pipesvc.core.limits import parse_bytes
from tests.support.reference import Problem, Reference

# 4 layers of 263, 263, 263 and 8 kB of float32 weights; with gradients and SGD's momentum a
# stage needs 3x that: 2.4 MB for the whole model, 0.79 MB for one wide layer.
WIDE = Problem(
    "mlp",
    {"in_features": 256, "hidden_features": 256, "out_features": 8, "num_layers": 4},
    "mse",
    (256,),
    target_shape=(8,),
)
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def test_parse_bytes() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("1.5M") == 1_500_000
    assert parse_bytes("4096") == 4096
    for bad in ("", "12XB", "-1G", "0"):
        with pytest.raises(pipesvc.InvalidArgumentError, match="size"):
            parse_bytes(bad)


def test_memory_partition_fits_budgets_no_single_stage_could() -> None:
    with (
        pipesvc.LocalCluster(
            num_stages=1, threads_per_stage=1, stage_args=["--memory-budget", "0.9MiB"]
        ) as cluster,
        cluster.connect() as client,
    ):
        cluster.add_stage(["--memory-budget", "2MiB"])
        small = client.stages()[0].address
        options = {
            "model": "mlp",
            "model_args": WIDE.model_args,
            "num_microbatches": 2,
            "loss": "mse",
            "optimizer": OPTIMIZER,
        }
        with pytest.raises(pipesvc.ResourceExhaustedError, match=rf"{small}.*MiB; it has 1 MiB"):
            client.create_job(num_stages=1, **options)  # type: ignore[arg-type]
        # Balancing parameters ignores the budgets and overfills the small stage...
        with pytest.raises(pipesvc.ResourceExhaustedError, match=small):
            client.create_job(num_stages=2, partition="parameters", **options)  # type: ignore[arg-type]
        # ...the memory partition gives it one layer and the big stage the rest.
        reference = Reference(WIDE, seed=0, optimizer=OPTIMIZER, clip_grad_norm=None)
        with client.create_job(num_stages=2, partition="memory", **options) as job:  # type: ignore[arg-type]
            assert [(s.start_layer, s.end_layer) for s in job.plan] == [(0, 1), (1, 4)]
            for step in range(3):
                x, y = WIDE.batch(6, seed=step)
                assert job.train_step(x, y) == pytest.approx(reference.step(x, y), rel=1e-5)
            weights = job.state_dict()
            for key, value in reference.model.state_dict().items():
                torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)


def test_memory_partition_counts_activations_in_flight() -> None:
    """With an input shape the estimate adds the activations each rank keeps: 1F1B keeps two
    micro-batches on rank 0 and one on rank 1 here, so rank 1 takes more layers than weights
    alone would give it; GPipe keeps all four everywhere, which fits nowhere."""
    budget = 2_000_000  # bytes; per layer: 0.79 MB of SGD state, 0.13 MB of activations a batch
    with (
        pipesvc.LocalCluster(
            num_stages=2, threads_per_stage=1, stage_args=["--memory-budget", str(budget)]
        ) as cluster,
        cluster.connect() as client,
    ):
        options = {
            "model": "mlp",
            "model_args": WIDE.model_args,
            "num_stages": 2,
            "num_microbatches": 4,
            "loss": "mse",
            "optimizer": OPTIMIZER,
            "partition": "memory",
        }
        with client.create_job(**options) as job:  # type: ignore[arg-type]
            assert [(s.start_layer, s.end_layer) for s in job.plan] == [(0, 2), (2, 4)]
        with pytest.raises(pipesvc.ResourceExhaustedError, match="4 micro-batches of activations"):
            client.create_job(**options, schedule="gpipe", input_shape=(64, 256))  # type: ignore[arg-type]
        reference = Reference(WIDE, seed=0, optimizer=OPTIMIZER, clip_grad_norm=None)
        with client.create_job(**options, input_shape=(64, 256)) as job:  # type: ignore[arg-type]
            assert [(s.start_layer, s.end_layer) for s in job.plan] == [(0, 1), (1, 4)]
            for step in range(2):
                x, y = WIDE.batch(4 * 64, seed=step)
                assert job.train_step(x, y) == pytest.approx(reference.step(x, y), rel=1e-5)
