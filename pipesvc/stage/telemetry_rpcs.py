"""The stage's telemetry RPCs: what it is and holds (Info), its measured layer times and
calibrated speed (Profile), and its recent runs' timed events (GetTrace)."""

from __future__ import annotations

import math
import os
import threading

import torch

from pipesvc import models
from pipesvc.errors import InvalidArgumentError
from pipesvc.stage.assignment import Assignment
from pipesvc.stage.compute.profiler import calibrate
from pipesvc.stage.options import StageOptions
from pipesvc.v1 import common_pb2, stage_pb2
from pipesvc.wire.rpc_status import handle_errors

MAX_CALIBRATE_S = 5.0
"""The longest calibration a Profile call may ask for."""


def _rss_bytes() -> int:
    """Resident memory of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class TelemetryRpcs:
    """Info, Profile and GetTrace of ``StageService``, which provides the job lookup, the job
    it holds (under its lock), the options and its Control streams' counts."""

    _options: StageOptions
    _lock: threading.Lock
    _job: Assignment | None
    _control_opened: int
    _control_open: int

    def _current(self, job_id: str, epoch: int | None = None) -> Assignment:
        raise NotImplementedError

    @handle_errors
    def Info(self, request: stage_pb2.InfoRequest, context: object) -> stage_pb2.StageInfo:
        info = stage_pb2.StageInfo(
            address=self._options.address,
            device=str(self._options.device),
            memory_bytes=self._options.memory_bytes,
            models=models.known_models(),
            num_threads=torch.get_num_threads(),
            pid=os.getpid(),
            rss_bytes=_rss_bytes(),
        )
        with self._lock:
            job = self._job
        if job is not None:
            rt = job.runtime
            info.job_id = job.job_id
            info.start_layer, info.end_layer, info.rank = rt.start_layer, rt.end_layer, rt.rank
            info.parameter_names.extend(name for name, _ in rt.module.named_parameters())
            info.num_parameters = rt.num_parameters
            step, last_run_id, pending = job.engine.progress()
            info.step = step
            info.peak_in_flight = rt.peak_in_flight
            info.num_duplicates_dropped = job.mailbox.num_duplicates
            info.num_stale_dropped = job.mailbox.num_stale
            info.plan_epoch = job.epoch
            info.last_run_id = last_run_id
            info.pending_run_id = pending or 0
            info.microbatches_per_s = job.engine.recorder.microbatches_per_s
            info.downstream_shm = job.downstream is not None and job.downstream.uses_shm
            info.upstream_shm = job.upstream is not None and job.upstream.uses_shm
            sessions = job.engine.sessions
            if sessions is not None:  # a read only: expiry has its own timer
                info.sessions = len(sessions.sessions())
                info.cache_bytes = sessions.total_bytes()
        with self._lock:
            info.control_streams_opened = self._control_opened
            info.control_streams_open = self._control_open
        return info

    @handle_errors
    def Profile(self, request: stage_pb2.ProfileRequest, context: object) -> stage_pb2.StageProfile:
        job = self._current(request.job_id) if request.job_id else None
        if not (math.isfinite(request.calibrate_s) and 0 <= request.calibrate_s <= MAX_CALIBRATE_S):
            raise InvalidArgumentError(
                f"calibrate_s must be between 0 and {MAX_CALIBRATE_S} seconds; got "
                f"{request.calibrate_s}"
            )
        reply = stage_pb2.StageProfile(address=self._options.address)
        if job is not None:  # without a job id: a free stage's calibration only
            profiler = job.runtime.profiler
            measured = profiler.snapshot()
            if request.reset:
                profiler.reset()
            reply.layers.extend(
                stage_pb2.LayerTime(
                    index=t.index,
                    forward_s=t.forward_s,
                    backward_s=t.backward_s,
                    output_bytes=t.output_bytes,
                    flops=t.flops,
                )
                for t in measured.layers
            )
            reply.microbatches = measured.microbatches
            reply.send_bytes_per_s = measured.send_bytes_per_s
        if request.calibrate_s > 0:
            if job is None:
                reply.speed = calibrate(request.calibrate_s, self._options.device)
            else:
                with job.engine.run_lock:  # not while a run computes: it would slow both
                    reply.speed = calibrate(request.calibrate_s, self._options.device)
        return reply

    @handle_errors
    def GetTrace(
        self, request: common_pb2.GetTraceRequest, context: object
    ) -> common_pb2.StageTrace:
        job = self._current(request.job_id)
        return common_pb2.StageTrace(
            rank=job.runtime.rank,
            address=self._options.address,
            events=[
                common_pb2.TraceEvent(
                    run_id=e.run_id,
                    step=e.step,
                    name=e.name,
                    microbatch=e.microbatch,
                    start_unix_ns=e.start_ns,
                    end_unix_ns=e.end_ns,
                )
                for e in job.engine.recorder.events(request.max_runs)
            ],
        )
