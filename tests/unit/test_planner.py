"""Planning without processes: the pure placement (first plan, replan, spare selection, errors)
and the planner's registry side of a replan."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from pipesvc.coordinator import planner
from pipesvc.coordinator.stage_registry import StageRecord, StageRegistry
from pipesvc.core.config import JobConfig
from pipesvc.core.plan import PipelineStage
from pipesvc.core.planning import placement
from pipesvc.errors import PlanError, ResourceExhaustedError
from pipesvc.v1 import stage_pb2

MIB = 1 << 20


def _layers(*num_parameters: int) -> list[stage_pb2.LayerDescription]:
    return [
        stage_pb2.LayerDescription(index=i, num_parameters=n, parameter_bytes=4 * n)
        for i, n in enumerate(num_parameters)
    ]


def _stage(port: int, memory_bytes: int = 1 << 30) -> StageRecord:
    return StageRecord(
        address=f"127.0.0.1:{port}", device="cpu", memory_bytes=memory_bytes, models=("mlp",)
    )


def _plan(*entries: tuple[int, int, int]) -> list[PipelineStage]:
    return [
        PipelineStage(start_layer=start, end_layer=end, rank=rank, address=f"127.0.0.1:{port}")
        for rank, (start, end, port) in enumerate(entries)
    ]


def _replan(
    plan: list[PipelineStage],
    lost: set[str],
    candidates: list[StageRecord],
    health: dict[str, str],
    config: JobConfig | None = None,
    layers: list[stage_pb2.LayerDescription] | None = None,
) -> list[PipelineStage]:
    everyone = {s.address: _stage(int(s.address.rsplit(":", 1)[1])) for s in plan}
    everyone.update({c.address: c for c in candidates})
    return placement.replan(
        config or JobConfig(model="mlp", num_stages=len(plan)),
        layers or _layers(10, 10, 10, 10),
        plan,
        lost,
        candidates=candidates,
        health=health,
        stages=everyone,
        job_id="job-1",
    )


def test_first_plan_takes_the_first_free_stages_and_balances_parameters() -> None:
    config = JobConfig(model="mlp", num_stages=2)
    free = [_stage(1), _stage(2), _stage(3)]
    plan = placement.first_plan(config, _layers(30, 10, 10, 10), free, num_registered=3)
    assert plan == _plan((0, 1, 1), (1, 4, 2))


def test_first_plan_with_too_few_free_stages_names_the_numbers() -> None:
    config = JobConfig(model="mlp", num_stages=3)
    with pytest.raises(PlanError) as raised:
        placement.first_plan(config, _layers(1, 1, 1, 1), [_stage(1), _stage(2)], 5)
    assert str(raised.value) == (
        "num_stages (3) exceeds the free stages that can build 'mlp' (2 of 5 registered)"
    )


def test_first_plan_refuses_a_share_that_does_not_fit_a_stage() -> None:
    config = JobConfig(model="mlp", num_stages=2)
    layers = _layers(MIB, MIB)  # 4 MiB of weights each: 16 MiB with gradients and momentum
    with pytest.raises(ResourceExhaustedError, match=r"127.0.0.1:2 would hold layers \[1, 2\)"):
        placement.first_plan(config, layers, [_stage(1), _stage(2, memory_bytes=MIB)], 2)


def test_replan_without_lost_stages_keeps_the_plan() -> None:
    plan = _plan((0, 2, 1), (2, 4, 2))
    assert _replan(plan, set(), [], {}) == plan


def test_replan_gives_a_lost_stage_the_first_serving_spare_and_keeps_the_ranges() -> None:
    plan = _plan((0, 1, 1), (1, 3, 2), (3, 4, 3))
    candidates = [_stage(4), _stage(5), _stage(6)]
    health = {"127.0.0.1:4": "NOT_SERVING", "127.0.0.1:5": "UNREACHABLE", "127.0.0.1:6": "SERVING"}
    new_plan = _replan(plan, {"127.0.0.1:2"}, candidates, health)
    assert new_plan == _plan((0, 1, 1), (1, 3, 6), (3, 4, 3))


def test_replan_without_enough_spares_repartitions_over_survivors_and_spares(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan = _plan((0, 1, 1), (1, 2, 2), (2, 4, 3))
    lost = {"127.0.0.1:1", "127.0.0.1:2"}
    with caplog.at_level(logging.WARNING, logger=placement.__name__):
        new_plan = _replan(plan, lost, [_stage(4)], {"127.0.0.1:4": "SERVING"})
    assert new_plan == _plan((0, 2, 3), (2, 4, 4))
    assert "job job-1: no spare for every lost stage; re-partitioning over 2 stages" in (
        caplog.messages
    )


def test_replan_uses_at_most_one_stage_per_layer() -> None:
    plan = _plan((0, 1, 1), (1, 2, 2), (2, 3, 3))
    new_plan = _replan(plan, {"127.0.0.1:3"}, [], {}, layers=_layers(5, 5, 5))
    assert new_plan == _plan((0, 2, 1), (2, 3, 2))
    two_layers = _plan((0, 1, 1), (1, 2, 2))
    spares = [_stage(4), _stage(5)]
    health = {s.address: "SERVING" for s in spares}
    # Both lost, two spares: each replaced in place.
    lost = {"127.0.0.1:1", "127.0.0.1:2"}
    assert _replan(two_layers, lost, spares, health, layers=_layers(5, 5)) == _plan(
        (0, 1, 4), (1, 2, 5)
    )


def test_replan_with_every_stage_lost_and_no_spare_is_a_plan_error() -> None:
    plan = _plan((0, 2, 1), (2, 4, 2))
    with pytest.raises(PlanError) as raised:
        _replan(plan, {"127.0.0.1:1", "127.0.0.1:2"}, [_stage(3)], {"127.0.0.1:3": "NOT_SERVING"})
    assert str(raised.value) == "job job-1: every stage is lost and no spare is registered"


def test_planner_replan_marks_lost_claims_the_spare_and_places_the_plan() -> None:
    registry = StageRegistry()
    for port in (1, 2, 3, 4):
        registry.register(_stage(port))
    plan = _plan((0, 2, 1), (2, 4, 2))
    assert registry.claim([s.address for s in plan], "job-1")
    config = JobConfig(model="mlp", num_stages=2)
    lost = {"127.0.0.1:2"}
    candidates = planner.spare_candidates(registry, config, lost)
    assert [c.address for c in candidates] == ["127.0.0.1:3", "127.0.0.1:4"]
    health = {"127.0.0.1:3": "NOT_SERVING", "127.0.0.1:4": "SERVING"}
    new_plan = planner.plan_after_loss(
        registry,
        config,
        _layers(10, 10, 10, 10),
        plan,
        lost,
        "job-1",
        candidates=candidates,
        health=health,
    )
    assert new_plan == _plan((0, 2, 1), (2, 4, 4))
    records = {r.address: r for r in registry.all()}
    assert not records["127.0.0.1:2"].alive and records["127.0.0.1:2"].job_id == ""
    assert records["127.0.0.1:3"].job_id == ""
    placed = records["127.0.0.1:4"]
    assert (placed.job_id, placed.rank, placed.start_layer, placed.end_layer) == ("job-1", 1, 2, 4)


def test_placement_makes_no_calls() -> None:
    """Placement is pure: nothing of gRPC, nor of the coordinator's calling modules."""
    tree = ast.parse(Path(placement.__file__).read_text())
    imported = [
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    assert not [m for m in imported if m.startswith(("grpc", "pipesvc.coordinator"))]
    assert not [m for m in imported if m.endswith("_grpc") or m == "pipesvc.wire.transport"]


def test_memory_estimate_counts_gradients_and_state_only_for_what_trains() -> None:
    full = _layers(1000, 1000)
    frozen = _layers(1000, 1000)
    frozen[1].trainable_bytes = 400  # a LoRA layer: 100 trainable float32 parameters
    frozen[0].trainable_bytes = 0  # a frozen embedding
    # AdamW: weights, gradients and two moments of everything that trains.
    assert placement.memory_estimate(full, 0, 2, "adamw") == 8000 * 4
    assert placement.memory_estimate(frozen, 0, 2, "adamw") == 8000 + 400 * 3
    assert placement.memory_estimate(full, 0, 2, "adamw", precision="bf16") == 8000 * 2
    assert placement.memory_estimate(full, 0, 2, "adamw", precision="bf16-mixed") == 8000 * 4
    # An inference job (optimizer=None) holds the weights only.
    assert placement.memory_estimate(full, 0, 2, "none") == 8000


def test_a_lora_job_fits_a_stage_its_full_training_would_not() -> None:
    layers = _layers(1_000_000, 1_000_000)
    for layer in layers:
        layer.trainable_bytes = 4096
    stage = _stage(1, memory_bytes=10 * MIB)
    config = JobConfig(model="m", num_stages=1, optimizer={"name": "adamw"})
    plan = placement.first_plan(config, layers, [stage], 1)
    assert [(p.start_layer, p.end_layer) for p in plan] == [(0, 2)]
    with pytest.raises(ResourceExhaustedError, match="needing about 31 MiB"):
        placement.first_plan(config, _layers(1_000_000, 1_000_000), [stage], 1)
