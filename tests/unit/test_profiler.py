"""A stage's own timings, and the costs and speeds the coordinator derives from them."""

from __future__ import annotations

import math

import pytest
import torch

from pipesvc.coordinator.stage_registry import StageRecord
from pipesvc.core.plan import PipelineStage
from pipesvc.core.planning.measured import measurements
from pipesvc.errors import FailedPreconditionError
from pipesvc.stage.compute.profiler import RECENT, StageProfiler
from pipesvc.v1 import stage_pb2


def test_means_drop_the_warm_up_and_follow_a_change() -> None:
    profiler = StageProfiler()
    out = torch.zeros(4, 8)
    profiler.layer(3, 10.0, out)  # the warm-up sample: dropped
    for _ in range(4):
        profiler.layer(3, 1.0, out)
        profiler.layer(4, 3.0, out)
    for _ in range(5):
        profiler.backward(8.0)
    profiler.sent(1000, 0.5)
    profiler.sent(1000, 0.5)
    profiler.sent(1000, 0.25)
    measured = profiler.snapshot()
    first, second = measured.layers
    # Layer 4's first sample was its warm-up too; backward is shared by forward time.
    assert (first.index, first.forward_s, second.forward_s) == (3, 1.0, 3.0)
    assert (first.backward_s, second.backward_s) == (2.0, 6.0)
    assert first.output_bytes == 4 * 8 * 4 and measured.microbatches == 4
    assert measured.send_bytes_per_s == pytest.approx(3000.0)  # the mean of 2000 and 4000
    for _ in range(int(1 / RECENT) * 10):  # the stage slows down: the mean follows
        profiler.layer(3, 5.0, out)
    assert profiler.snapshot().layers[0].forward_s == pytest.approx(5.0, rel=1e-3)
    profiler.reset()
    assert profiler.snapshot().layers == [] and profiler.needs_flops(3)


def _profile(
    layers: list[tuple[int, float, float, int]], speed: float = 0.0
) -> stage_pb2.StageProfile:
    return stage_pb2.StageProfile(
        layers=[
            stage_pb2.LayerTime(index=i, forward_s=f, backward_s=b, output_bytes=100, flops=n)
            for i, f, b, n in layers
        ],
        speed=speed,
        send_bytes_per_s=1e6,
    )


def _stage(start: int, end: int, rank: int, address: str) -> PipelineStage:
    return PipelineStage(start_layer=start, end_layer=end, rank=rank, address=address)


def _record(address: str) -> StageRecord:
    return StageRecord(address=address, device="cpu", memory_bytes=1 << 30, models=("mlp",))


def test_costs_are_the_same_layer_wherever_it_ran_and_free_stages_get_scaled_speeds() -> None:
    """Four equal layers; the second stage runs them at half speed. Costs come out equal,
    the speeds 2:1, and a free stage calibrated as fast as the first gets its speed."""
    plan = [_stage(0, 2, 0, "a"), _stage(2, 4, 1, "b")]
    fast = _profile([(0, 1.0, 2.0, 100), (1, 1.0, 2.0, 100)], speed=10.0)
    slow = _profile([(2, 2.0, 4.0, 100), (3, 2.0, 4.0, 100)], speed=5.0)
    spare = stage_pb2.StageProfile(speed=10.0)
    measured = measurements(
        plan, 4, [_record("a"), _record("b"), _record("c")], [fast, slow, spare]
    )
    assert measured.costs.work == [300.0] * 4
    assert [r.speed for r in measured.rates] == [100.0, 50.0, 100.0]
    assert measured.current_s[1] == pytest.approx(12.0)  # 600 work at 50 per second
    assert math.isclose(measured.current_s[0], 6.0 + 2 * 100 / 1e6)


def test_a_layer_without_timings_is_refused() -> None:
    plan = [_stage(0, 1, 0, "a"), _stage(1, 2, 1, "b")]
    profiles = [_profile([(0, 1.0, 1.0, 10)]), _profile([])]
    with pytest.raises(FailedPreconditionError, match="layer 1 has no timings"):
        measurements(plan, 2, [_record("a"), _record("b")], profiles)
