"""Replicated plans without processes: shares of a step, plan checks, where replicas go, and
what a lost stage does to them (see [Note: replicas] and [Note: replica placement])."""

from __future__ import annotations

import pytest

from pipesvc.coordinator.stage_registry import StageRecord
from pipesvc.core.config import JobConfig, config_from_proto, config_to_proto
from pipesvc.core.health import Health
from pipesvc.core.microbatch import replica_shares
from pipesvc.core.plan import PipelineStage, check_plan, plan_from_dicts, plan_to_dicts
from pipesvc.core.planning import placement
from pipesvc.errors import InvalidArgumentError, PlanError, ResourceExhaustedError
from pipesvc.v1 import stage_pb2

GIB = 1 << 30


def _layers(
    count: int, *, params: int = 100, activation_bytes: int = 0
) -> list[stage_pb2.LayerDescription]:
    return [
        stage_pb2.LayerDescription(
            index=i,
            num_parameters=params,
            parameter_bytes=4 * params,
            activation_bytes=activation_bytes,
        )
        for i in range(count)
    ]


def _stage(address: str, memory_bytes: int = GIB) -> StageRecord:
    return StageRecord(address=address, device="cpu", memory_bytes=memory_bytes, models=("mlp",))


def _config(replicas: int, stages: int, **kw: object) -> JobConfig:
    return JobConfig(model="mlp", num_stages=stages, data_parallel=replicas, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("count", "replicas", "sizes"),
    [(6, 3, [2, 2, 2]), (7, 3, [3, 2, 2]), (8, 3, [3, 3, 2]), (2, 3, [1, 1, 0]), (5, 1, [5])],
)
def test_shares_are_contiguous_and_even(count: int, replicas: int, sizes: list[int]) -> None:
    shares = replica_shares(count, replicas)
    assert [len(s) for s in shares] == sizes
    assert [i for s in shares for i in s] == list(range(count))


def _replicated(cuts: list[tuple[int, int]], replicas: int) -> list[PipelineStage]:
    return [
        PipelineStage(start_layer=a, end_layer=b, rank=k, replica=r, address=f"h{r}:{k + 1}")
        for r in range(replicas)
        for k, (a, b) in enumerate(cuts)
    ]


def test_a_replicated_plan_checks_and_round_trips() -> None:
    plan = _replicated([(0, 2), (2, 5)], 3)
    check_plan(plan, 5)
    assert plan_from_dicts(plan_to_dicts(plan)) == plan
    assert [PipelineStage.from_proto(s.to_proto()) for s in plan] == plan
    old_row = {"start_layer": 0, "end_layer": 5, "rank": 0, "address": "a:1"}
    assert plan_from_dicts([old_row])[0].replica == 0, "a row saved before replicas reads as 0"


@pytest.mark.parametrize(
    ("plan", "named"),
    [
        (_replicated([(0, 2), (2, 5)], 2)[::-1], "listed in order"),
        ([*_replicated([(0, 2), (2, 5)], 1), *_replicated([(0, 3), (3, 5)], 2)[2:]], "cut"),
        (
            [*_replicated([(0, 2), (2, 5)], 1), *_replicated([(0, 2), (2, 5)], 1)],
            "stage 2 has rank 0",
        ),
        (
            [
                *_replicated([(0, 2), (2, 5)], 2)[:3],
                PipelineStage(start_layer=2, end_layer=5, rank=1, replica=1, address="h0:1"),
            ],
            "twice",
        ),
        (_replicated([(0, 2), (2, 4)], 2), "covers 4 layers of 5"),
    ],
)
def test_bad_replicated_plans_are_refused(plan: list[PipelineStage], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        check_plan(plan, 5)


def test_replica_options_round_trip_and_older_specs_mean_one_replica() -> None:
    config = _config(3, 2, min_replicas=2)
    assert config_from_proto(config_to_proto(config)) == config
    assert config.step_microbatches == 3 * config.num_microbatches
    assert config.total_stages == 6
    old = config_to_proto(_config(1, 2))
    old.ClearField("data_parallel")
    assert config_from_proto(old).data_parallel == 1


def test_one_host_keeps_registration_order() -> None:
    stages = [_stage(f"127.0.0.1:{port}") for port in range(1, 7)]
    plan = placement.first_plan(_config(3, 2), _layers(4), stages, 6)
    assert [(s.replica, s.rank, s.address) for s in plan] == [
        (r, k, f"127.0.0.1:{2 * r + k + 1}") for r in range(3) for k in range(2)
    ]


def _two_hosts() -> list[StageRecord]:
    # Registered alternately: a:1, b:1, a:2, b:2.
    return [_stage("a:1"), _stage("b:1"), _stage("a:2"), _stage("b:2")]


def test_big_activations_keep_each_pipeline_on_one_host() -> None:
    layers = _layers(4, params=10, activation_bytes=64 << 20)
    plan = placement.first_plan(_config(2, 2, input_shape=(8, 16)), layers, _two_hosts(), 4)
    hosts = [[s.address[0] for s in plan if s.replica == r] for r in range(2)]
    assert hosts == [["a", "a"], ["b", "b"]]


def test_big_gradients_keep_each_rank_on_one_host() -> None:
    layers = _layers(4, params=1 << 24, activation_bytes=1024)
    plan = placement.first_plan(_config(2, 2, input_shape=(8, 16)), layers, _two_hosts(), 4)
    hosts = [[s.address[0] for s in plan if s.rank == k] for k in range(2)]
    assert hosts == [["a", "a"], ["b", "b"]]


def test_a_rank_fits_its_smallest_stage() -> None:
    stages = [_stage("h:1"), _stage("h:2"), _stage("h:3", 100), _stage("h:4")]
    with pytest.raises(ResourceExhaustedError, match="h:3"):
        placement.first_plan(_config(2, 2), _layers(4), stages, 4)


def test_too_few_stages_names_both_factors() -> None:
    with pytest.raises(PlanError, match=r"num_stages x data_parallel \(2 x 3\)"):
        placement.first_plan(_config(3, 2), _layers(4), [_stage(f"h:{i}") for i in range(5)], 5)


def _replan(
    plan: list[PipelineStage], lost: set[str], spares: list[str], config: JobConfig
) -> list[PipelineStage]:
    candidates = [_stage(a) for a in spares]
    everyone = {s.address: _stage(s.address) for s in plan} | {c.address: c for c in candidates}
    return placement.replan(
        config,
        _layers(5),
        plan,
        lost,
        candidates=candidates,
        health={a: Health.SERVING for a in spares},
        stages=everyone,
        job_id="job",
    )


def test_a_spare_takes_the_lost_stage_s_place() -> None:
    plan = _replicated([(0, 2), (2, 5)], 3)
    new = _replan(plan, {"h1:2"}, ["s:1"], _config(3, 2))
    assert [(s.replica, s.rank, s.address) for s in new] == [
        (s.replica, s.rank, "s:1" if s.address == "h1:2" else s.address) for s in plan
    ]
    assert [(s.start_layer, s.end_layer) for s in new] == [
        (s.start_layer, s.end_layer) for s in plan
    ]


def test_replicas_without_spares_are_dropped_down_to_min_replicas() -> None:
    plan = _replicated([(0, 2), (2, 5)], 3)
    new = _replan(plan, {"h0:1", "h2:2"}, ["s:1"], _config(3, 2, min_replicas=1))
    # Replica 0 gets the spare; replica 2 has none left and is dropped; replica 1 becomes... 1.
    assert [(s.replica, s.rank, s.address) for s in new] == [
        (0, 0, "s:1"),
        (0, 1, "h0:2"),
        (1, 0, "h1:1"),
        (1, 1, "h1:2"),
    ]


def test_dropping_below_min_replicas_is_refused() -> None:
    plan = _replicated([(0, 2), (2, 5)], 2)
    with pytest.raises(PlanError, match=r"below min_replicas \(2\)"):
        _replan(plan, {"h1:1"}, [], _config(2, 2))
