"""A client's ``Job`` follows the descriptions of the job that replies carry (see [Note: fresh
handle] in pipesvc/client/job.py): what changed is read again, what did not is kept."""

from __future__ import annotations

from typing import Any

from pipesvc.client.job import Job
from pipesvc.core.config import JobConfig, config_to_proto
from pipesvc.core.plan import PipelineStage
from pipesvc.v1 import coordinator_pb2


def _info(config: JobConfig, plan: list[PipelineStage], step: int) -> coordinator_pb2.JobInfo:
    return coordinator_pb2.JobInfo(
        job_id="j",
        spec=config_to_proto(config),
        plan=[s.to_proto() for s in plan],
        plan_epoch=len(plan),
        step=step,
        num_layers=4,
    )


def _stage(rank: int, start: int, end: int) -> PipelineStage:
    return PipelineStage(start_layer=start, end_layer=end, rank=rank, address=f"h{rank}:1")


def test_a_reply_updates_what_changed_and_keeps_the_rest() -> None:
    config = JobConfig(model="mlp", num_stages=2)
    plan = [_stage(0, 0, 2), _stage(1, 2, 4)]
    client: Any = None  # no call is made
    job = Job(client, _info(config, plan, 0))
    first_config, first_plan = job.config, job.plan
    assert (first_config, first_plan) == (config, plan)

    job._update(_info(config, plan, 1))  # a step: only the step moved
    assert job.step == 1
    assert job.config is first_config and job.plan is first_plan

    moved = [_stage(0, 0, 1), _stage(1, 1, 4)]
    job._update(_info(config, moved, 2))  # a recovery or replan moved layers
    assert job.plan == moved and job.config is first_config

    other = JobConfig(model="mlp", num_stages=2, partition="parameters")
    job._update(_info(other, moved, 3))
    assert job.config == other and job.plan == moved


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_reply_per_step_does_not_grow_the_client() -> None:
    """Every step's reply carries the job and ``_update`` reads it. It used to copy each into
    one message kept for good, whose protobuf (upb) arena frees nothing until the message
    goes: the client grew by ~0.5 KiB a step, ~50 MiB over the 100,000 replies here. Kept as
    it came, each reply's memory goes with the next."""
    config = JobConfig(model="mlp", num_stages=2)
    plan = [_stage(0, 0, 2), _stage(1, 2, 4)]
    client: Any = None
    job = Job(client, _info(config, plan, 0))
    wire = [_info(config, plan, step).SerializeToString() for step in (1, 2)]
    for step in range(2000):  # allocator warm-up
        job._update(coordinator_pb2.JobInfo.FromString(wire[step % 2]))
    before = _rss_bytes()
    for step in range(100_000):
        job._update(coordinator_pb2.JobInfo.FromString(wire[step % 2]))
    grown = _rss_bytes() - before
    assert job.step == 2
    assert grown < 8 << 20, f"the client grew by {grown / 2**20:.1f} MiB over 100,000 replies"
