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
