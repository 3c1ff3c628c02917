"""``Job.timelines`` and ``Job.trace``: every stage's timed actions, read from the
coordinator, and written as Chrome trace JSON and a PNG timeline."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipesvc.observe.trace import StageTimeline, TraceEvent, write_trace_files
from pipesvc.v1 import common_pb2

if TYPE_CHECKING:
    from pipesvc.client.job import Job


def timelines(job: Job, max_runs: int) -> list[StageTimeline]:
    """See ``Job.timelines``."""
    client = job._client
    reply = client._call(
        client._stub.GetTrace, common_pb2.GetTraceRequest(job_id=job.id, max_runs=max_runs)
    )
    replicated = any(stage.replica for stage in reply.stages)
    # With replicas, one lane per stage in plan order, each labelled with its replica.
    return [
        StageTimeline(
            rank=lane if replicated else stage.rank,
            address=(
                f"{stage.address} replica {stage.replica} rank {stage.rank}"
                if replicated
                else stage.address
            ),
            events=tuple(
                TraceEvent(
                    run_id=e.run_id,
                    step=e.step,
                    name=e.name,
                    microbatch=e.microbatch,
                    start_ns=e.start_unix_ns,
                    end_ns=e.end_unix_ns,
                )
                for e in stage.events
            ),
        )
        for lane, stage in enumerate(reply.stages)
    ]


def trace(job: Job, path: str | Path, max_runs: int) -> tuple[Path, Path]:
    """See ``Job.trace``."""
    stem = Path(path)
    if stem.suffix in (".json", ".png"):
        stem = stem.with_suffix("")
    c = job.config
    title = (
        f"job {job.id}: {c.model}, {c.schedule}, {len(job.plan)} stages x "
        f"{c.num_microbatches} micro-batches"
    )
    return write_trace_files(timelines(job, max_runs), stem, title=title)
