"""The coordinator's bounded wait for stages: the registry wakes waiters, the planner checks
and caps the wait."""

from __future__ import annotations

import math
import threading

import pytest

from pipesvc.coordinator import planner
from pipesvc.coordinator.stage_registry import StageRecord, StageRegistry
from pipesvc.core.config import JobConfig
from pipesvc.errors import InvalidArgumentError


def _record(port: int, models: tuple[str, ...] = ("mlp",)) -> StageRecord:
    return StageRecord(
        address=f"127.0.0.1:{port}", device="cpu", memory_bytes=1 << 30, models=models
    )


def test_wait_free_wakes_when_a_stage_registers() -> None:
    registry = StageRegistry()
    registry.register(_record(1))
    registry.register(_record(2, models=("gpt",)))  # cannot build mlp: does not count
    # The third stage registers a moment after the wait began; the registration, not the
    # generous timeout, ends the wait.
    thread = threading.Timer(0.2, registry.register, args=(_record(3),))
    thread.start()
    assert registry.wait_free("mlp", 2, timeout_s=60) == 2
    thread.join()


def test_wait_free_wakes_when_a_job_releases_its_stages() -> None:
    registry = StageRegistry()
    registry.register(_record(1))
    registry.register(_record(2))
    assert registry.claim(["127.0.0.1:1"], "job-a")
    thread = threading.Timer(0.2, registry.release, args=("job-a",))
    thread.start()
    assert registry.wait_free("mlp", 2, timeout_s=60) == 2
    thread.join()


def test_wait_free_gives_up_at_its_timeout_with_the_count() -> None:
    registry = StageRegistry()
    registry.register(_record(1))
    assert registry.wait_free("mlp", 3, timeout_s=0.05) == 1
    assert registry.wait_free("mlp", 1, timeout_s=0) == 1


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_wait_for_stages_rejects_bad_seconds(bad: float) -> None:
    config = JobConfig(model="mlp", num_stages=2)
    with pytest.raises(InvalidArgumentError, match=r"wait_for_stages_s \((-1.0|nan|inf)\)"):
        planner.wait_for_stages(StageRegistry(), config, bad)


def test_wait_for_stages_takes_at_most_half_the_call_deadline() -> None:
    config = JobConfig(model="mlp", num_stages=2)
    calls: list[float] = []

    class Spy(StageRegistry):
        def wait_free(self, model: str, count: int, timeout_s: float) -> int:
            calls.append(timeout_s)
            return 0

    spy = Spy()
    planner.wait_for_stages(spy, config, 30.0, call_remaining_s=10.0)
    planner.wait_for_stages(spy, config, 3.0, call_remaining_s=10.0)
    planner.wait_for_stages(spy, config, 0.0, call_remaining_s=10.0)  # no wait at all
    planner.wait_for_stages(spy, config, 1e9)
    assert calls == [5.0, 3.0, planner.MAX_WAIT_FOR_STAGES_S]


def test_refused_stages_are_remembered_for_a_while_and_named_by_planning_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """See [Note: wire protocol]: the newest refusal first, one per address, bounded; a
    repeat is not news (a refused stage retries with every heartbeat); a stage that registers
    later is no longer a refusal; a job that finds too few stages says that some were
    refused."""
    from pipesvc.coordinator import stage_registry
    from pipesvc.errors import PlanError, UnknownModelError
    from pipesvc.v1 import stage_pb2

    registry = StageRegistry()
    registry.register(_record(1))
    assert registry.refuse("127.0.0.1:2", "two: another version")  # news: logged
    assert registry.refuse("127.0.0.1:3", "three: another version")
    assert not registry.refuse("127.0.0.1:2", "two: another version")  # its next heartbeat
    assert registry.refuse("127.0.0.1:2", "two again")  # another reason is news again
    assert registry.refusals() == ["two again", "three: another version"]
    registry.register(_record(3))
    assert registry.refusals() == ["two again"]
    layers = [stage_pb2.LayerDescription(index=i, num_parameters=8) for i in range(4)]
    config = JobConfig(model="mlp", num_stages=3)
    with pytest.raises(PlanError, match=r"1 stage\(s\) were refused .*the latest: two again"):
        planner.plan_job(registry, config, layers, "job")
    # A recovery that finds no spare says so too.
    plan = planner.plan_job(registry, JobConfig(model="mlp", num_stages=2), layers, "job")
    lost = {s.address for s in plan}
    candidates = planner.spare_candidates(registry, config, lost)
    with pytest.raises(PlanError, match=r"1 stage\(s\) were refused .*the latest: two again"):
        planner.plan_after_loss(
            registry, config, layers, plan, lost, "job", candidates=candidates, health={}
        )
    empty = StageRegistry()
    empty.refuse("127.0.0.1:4", "four: another version")
    with pytest.raises(UnknownModelError, match=r"none \(no stages registered\)\. 1 stage"):
        planner.describe(empty, config, 5.0)

    for port in range(100, 100 + stage_registry.MAX_REFUSALS + 5):
        registry.refuse(f"127.0.0.1:{port}", f"refused {port}")
    refused = registry.refusals()
    assert len(refused) == stage_registry.MAX_REFUSALS
    assert refused[0] == f"refused {99 + stage_registry.MAX_REFUSALS + 5}"
    monkeypatch.setattr(stage_registry, "REFUSALS_KEPT_S", 0.0)
    assert registry.refusals() == []
