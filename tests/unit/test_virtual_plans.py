"""Plans whose stages hold several layer ranges (virtual stages), without processes: the cuts,
the memory check over a stage's chunks, the plan check, and a spare taking every chunk."""

from __future__ import annotations

import pytest

from pipesvc.coordinator.stage_registry import StageRecord
from pipesvc.core.config import JobConfig
from pipesvc.core.health import Health
from pipesvc.core.plan import PipelineStage, check_plan, servers_of
from pipesvc.core.planning import placement
from pipesvc.errors import InvalidArgumentError, ResourceExhaustedError
from pipesvc.v1 import stage_pb2

MIB = 1 << 20


def _layers(count: int, params: int = 1000) -> list[stage_pb2.LayerDescription]:
    return [
        stage_pb2.LayerDescription(index=i, num_parameters=params, parameter_bytes=4 * params)
        for i in range(count)
    ]


def _stage(port: int, memory_bytes: int = 1 << 30) -> StageRecord:
    return StageRecord(
        address=f"h:{port}", device="cpu", memory_bytes=memory_bytes, models=("mlp",)
    )


def _config(stages: int, chunks: int, **kw: object) -> JobConfig:
    return JobConfig(
        model="mlp",
        num_stages=stages,
        virtual_stages=chunks,
        schedule="interleaved-1f1b",
        partition="uniform",
        **kw,  # type: ignore[arg-type]
    )


def test_ranges_go_round_the_stages() -> None:
    plan = placement.first_plan(_config(3, 2), _layers(12), [_stage(p) for p in range(3)], 3)
    assert [(s.start_layer, s.end_layer, s.rank, s.chunk, s.address) for s in plan] == [
        (2 * v, 2 * v + 2, v % 3, v // 3, f"h:{v % 3}") for v in range(6)
    ]
    assert servers_of(plan) == plan[:3]


def test_a_stage_must_hold_all_its_chunks() -> None:
    # 12 layers of 1000 float32 parameters under SGD: 8 KB of weights and gradients each; a
    # stage holding 2 chunks of 2 layers needs 32 KB.
    stages = [_stage(0), _stage(1, 30 * 1024), _stage(2)]
    with pytest.raises(ResourceExhaustedError, match=r"h:1 would hold layers \[2, 4\), \[8, 10\)"):
        placement.first_plan(
            _config(3, 2, optimizer={"name": "sgd", "lr": 0.1}), _layers(12), stages, 3
        )


def test_too_few_layers_for_the_chunks_names_both_factors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"num_stages x virtual_stages \(3 x 2\)"):
        placement.first_plan(_config(3, 2), _layers(5), [_stage(p) for p in range(3)], 3)


def _chunked(addresses: list[str], chunks: int, width: int = 1) -> list[PipelineStage]:
    count = len(addresses)
    return [
        PipelineStage(
            start_layer=width * v,
            end_layer=width * (v + 1),
            rank=v % count,
            chunk=v // count,
            address=addresses[v % count],
        )
        for v in range(count * chunks)
    ]


@pytest.mark.parametrize(
    ("plan", "named"),
    [
        (_chunked(["a:1", "b:1"], 2)[::-1], "expected rank 0 and chunk 0"),
        (
            [
                *_chunked(["a:1", "b:1"], 2)[:3],
                PipelineStage(start_layer=3, end_layer=4, rank=1, chunk=1, address="c:1"),
            ],
            "its rank's chunk 0 on 'b:1'",
        ),
    ],
)
def test_bad_chunked_plans_are_refused(plan: list[PipelineStage], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        check_plan(plan, 4)


def test_a_spare_takes_every_chunk_of_a_lost_stage() -> None:
    plan = _chunked(["h:0", "h:1", "h:2"], 2, width=2)
    spare = _stage(9)
    everyone = {s.address: _stage(int(s.address[2:])) for s in plan} | {spare.address: spare}
    new = placement.replan(
        _config(3, 2),
        _layers(12),
        plan,
        {"h:1"},
        candidates=[spare],
        health={spare.address: Health.SERVING},
        stages=everyone,
        job_id="job",
    )
    assert [s.address for s in new] == ["h:0", "h:9", "h:2"] * 2
    assert [(s.start_layer, s.end_layer) for s in new] == [
        (s.start_layer, s.end_layer) for s in plan
    ]


def test_without_a_spare_the_survivors_are_cut_again() -> None:
    plan = _chunked(["h:0", "h:1", "h:2"], 2, width=2)
    everyone = {s.address: _stage(int(s.address[2:])) for s in plan}
    new = placement.replan(
        _config(3, 2),
        _layers(12),
        plan,
        {"h:1"},
        candidates=[],
        health={},
        stages=everyone,
        job_id="job",
    )
    assert [(s.rank, s.chunk, s.address) for s in new] == [
        (v % 2, v // 2, ("h:0", "h:2")[v % 2]) for v in range(4)
    ]
    check_plan(new, 12)
