"""A snapshot of the cluster for the live page (``pipesvc.observe.dashboard``), as plain data.

It asks the stages directly (Info, the newest run's trace, the profile's send rate) with short
deadlines and never takes a job's lock, so a page that polls every second does not hold a
step up; a stage that does not answer in time is shown without its figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc

from pipesvc.coordinator.job import JobDriver
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.core.link_codecs import links
from pipesvc.core.plan import PipelineStage
from pipesvc.observe.trace import COMPUTE_EVENTS
from pipesvc.v1 import common_pb2, stage_pb2
from pipesvc.v1.stage_pb2_grpc import StageServiceStub

CALL_TIMEOUT_S = 1.0
_INFO = stage_pb2.InfoRequest()
_Resp = TypeVar("_Resp")


def snapshot(registry: StageRegistry, jobs: Callable[[], list[JobDriver]]) -> dict[str, Any]:
    """The stages (registration, health, assignment, memory) and each open job (its plan over
    its layers, and per stage its last run's busy, wait and idle time and its send rate, and
    that run's timeline)."""
    records = registry.all()
    open_jobs = [j for j in jobs() if not j.closed]
    with futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(records)))) as pool:
        health = dict(
            zip(
                [r.address for r in records],
                pool.map(lambda r: registry.health(r.address, CALL_TIMEOUT_S).name, records),
                strict=True,
            )
        )
        infos = dict(
            zip(
                [r.address for r in records],
                pool.map(lambda r: _ask(registry, r.address, lambda s: s.Info, _INFO), records),
                strict=True,
            )
        )
        views = [_job_view(registry, job, infos, pool) for job in open_jobs]
    stages = []
    for r in records:
        info = infos.get(r.address)
        stages.append(
            {
                "address": r.address,
                "device": r.device,
                "health": health[r.address],
                "job": r.job_id,
                "rank": r.rank if r.job_id else None,
                "layers": [r.start_layer, r.end_layer] if r.job_id else None,
                "memory_budget_mb": r.memory_bytes / 2**20,
                "rss_mb": info.rss_bytes / 2**20 if info is not None else None,
            }
        )
    return {"time": time.time(), "stages": stages, "jobs": views}


def _ask(
    registry: StageRegistry,
    address: str,
    method: Callable[[StageServiceStub], Callable[..., _Resp]],
    request: Any,
) -> _Resp | None:
    """``method(stub)`` (``lambda stub: stub.Info``) on a stage, or None if it does not answer
    in time."""
    try:
        return method(registry.stub(address))(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError:
        return None


def _times(events: list[common_pb2.TraceEvent], window_ns: int) -> dict[str, float]:
    """One stage's share of the last run: its own span, and its compute, waits and idle time
    within the run's window (every stage's first to last event)."""
    busy = sum(e.end_unix_ns - e.start_unix_ns for e in events if e.name in COMPUTE_EVENTS)
    wait = sum(e.end_unix_ns - e.start_unix_ns for e in events if e.name == "wait")
    span = max(e.end_unix_ns for e in events) - min(e.start_unix_ns for e in events)
    return {
        "step_ms": span / 1e6,
        "busy_ms": busy / 1e6,
        "wait_ms": wait / 1e6,
        "idle_ms": max(0, window_ns - busy - wait) / 1e6,
    }


def _event(stage: PipelineStage, event: common_pb2.TraceEvent, origin_ns: int) -> dict[str, Any]:
    """One timed action of the last run, on the page's timeline (ms from the run's start)."""
    return {
        "rank": stage.rank,
        "replica": stage.replica,
        "name": event.name,
        "microbatch": event.microbatch,
        "start_ms": (event.start_unix_ns - origin_ns) / 1e6,
        "end_ms": (event.end_unix_ns - origin_ns) / 1e6,
    }


def _job_view(
    registry: StageRegistry,
    job: JobDriver,
    infos: dict[str, Any],
    pool: futures.ThreadPoolExecutor,
) -> dict[str, Any]:
    plan: list[PipelineStage] = list(job.group.servers)
    last_run = common_pb2.GetTraceRequest(job_id=job.job_id, max_runs=1)
    rates = stage_pb2.ProfileRequest(job_id=job.job_id)
    traces = list(
        pool.map(lambda s: _ask(registry, s.address, lambda stub: stub.GetTrace, last_run), plan)
    )
    profiles = list(
        pool.map(lambda s: _ask(registry, s.address, lambda stub: stub.Profile, rates), plan)
    )
    events = [e for t in traces if t is not None for e in t.events]
    origin = min((e.start_unix_ns for e in events), default=0)
    run_end = max((e.end_unix_ns for e in events), default=0)
    stages = []
    timeline: list[dict[str, Any]] = []
    for stage, trace, profile in zip(plan, traces, profiles, strict=True):
        info = infos.get(stage.address)
        row: dict[str, Any] = {
            "rank": stage.rank,
            "replica": stage.replica,
            "address": stage.address,
            "layers": [stage.start_layer, stage.end_layer],
            "rss_mb": info.rss_bytes / 2**20 if info is not None else None,
            "send_mb_s": (
                profile.send_bytes_per_s / 1e6
                if profile is not None and profile.send_bytes_per_s > 0
                else None  # the last stage sends no activations
            ),
        }
        mine = list(trace.events) if trace is not None else []
        if mine:
            row.update(_times(mine, run_end - origin))
            timeline += [_event(stage, e, origin) for e in mine]
        stages.append(row)
    return {
        "id": job.job_id,
        "model": job.config.model,
        "partition": job.config.partition,
        "step": job.step,
        "num_layers": len(job.layers),
        "stages": stages,
        "links": [
            {
                "from": link.source,
                "to": link.target % max(1, len({s.rank for s in plan})),
                "between_hosts": link.between_hosts,
                "activations": link.codecs[0] or "exact",
                "gradients": link.codecs[1] or "exact",
                "reason": link.reason,
            }
            for link in links(job.config, [s for s in plan if s.replica == 0])
        ],
        "run_ms": (run_end - origin) / 1e6,
        "timeline": timeline,
    }
