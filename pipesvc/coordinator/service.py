"""The coordinator servicer: a thin adapter from CoordinatorService RPCs to jobs and stages."""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from pipesvc.coordinator import planner
from pipesvc.coordinator.database import StateDB
from pipesvc.coordinator.job import JobDriver
from pipesvc.coordinator.job_open import create_job, reopen_job
from pipesvc.coordinator.job_storage import JobStorage
from pipesvc.coordinator.options import FORGET_STAGES_AFTER_S
from pipesvc.coordinator.replicas import Rendezvous
from pipesvc.coordinator.stage_calls import Deadlines, call_stage
from pipesvc.coordinator.stage_registry import StageRecord, StageRegistry
from pipesvc.coordinator.step_request import PreparedStep, StepBatch, forward_batch, train_batch
from pipesvc.coordinator.train_stream import Step, TrainStream, Upcoming
from pipesvc.core.config import config_from_proto
from pipesvc.core.health import Health
from pipesvc.core.limits import Limits
from pipesvc.core.sampling import Sampling
from pipesvc.core.tensor_codec import decode, encode
from pipesvc.core.version import VERSION
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    WireFormatError,
)
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, stage_pb2
from pipesvc.wire.payload_wire import Incoming
from pipesvc.wire.protocol import WIRE_PROTOCOL, check_stage
from pipesvc.wire.rpc_status import handle_errors
from pipesvc.wire.security import Security

logger = logging.getLogger(__name__)


def _in_terms_of_the_batch(
    error: InvalidArgumentError,
    job: JobDriver,
    inputs: torch.Tensor,
    targets: torch.Tensor | None,
) -> InvalidArgumentError:
    """The error with the batch the caller sent in front: a stage only sees its micro-batch,
    whose shape alone would not say which of the caller's tensors is wrong. Errors that
    already name the batch, or that come before it is split, are returned as they are."""
    rows = inputs.shape[0] if inputs.dim() else 0
    m = (
        job.config.num_microbatches
        if targets is not None
        else min(job.config.num_microbatches, rows)
    )
    if rows < m or m < 1 or str(list(inputs.shape)) in str(error):
        return error
    sent = f"inputs of shape {list(inputs.shape)}"
    if targets is not None:
        sent += f" and targets of shape {list(targets.shape)}"
    per_mb = -(-rows // m)
    size = f"{'about ' if rows % m else ''}{per_mb} row{'s' if per_mb > 1 else ''}"
    return type(error)(f"{sent}, run as {m} micro-batches of {size}: {error}")


@contextlib.contextmanager
def _batch_errors(
    job: JobDriver, inputs: torch.Tensor, targets: torch.Tensor | None
) -> Iterator[None]:
    """Inside, an InvalidArgumentError leaves in terms of the batch the caller sent
    (``_in_terms_of_the_batch``)."""
    try:
        yield
    except InvalidArgumentError as exc:
        better = _in_terms_of_the_batch(exc, job, inputs, targets)
        if better is exc:
            raise
        raise better from exc


def _train_reply(result: tuple[JobDriver, float, int]) -> coordinator_pb2.TrainStepResponse:
    """The reply to a decided step: its loss, its step and the job as it is now."""
    job, loss, step = result
    return coordinator_pb2.TrainStepResponse(loss=loss, step=step, job=job.info())


class _TrainCall:
    """A training step prepared for its job (``JobDriver.prepare_step``), run by a
    ``TrainStep`` call or in its turn in a ``Train`` stream."""

    def __init__(self, job: JobDriver, batch: StepBatch, prepared: PreparedStep) -> None:
        self.job, self.batch, self.prepared = job, batch, prepared

    def __call__(
        self, ahead: Upcoming[Step[tuple[JobDriver, float, int]]] | None
    ) -> tuple[JobDriver, float, int]:
        """Runs the step; the stream's next step may go ahead if it is the same job's (see
        [Note: steps ahead] in step_runner.py)."""

        def same_job(step: Step[tuple[JobDriver, float, int]]) -> PreparedStep | None:
            return step.prepared if isinstance(step, _TrainCall) and step.job is self.job else None

        batch = self.batch
        with _batch_errors(self.job, batch.inputs, batch.targets):
            next_step = ahead.map(same_job) if ahead is not None else None
            loss, step = self.job.train_prepared(self.prepared, batch.digest, next_step)
        return self.job, loss, step

    def end(self) -> None:
        self.job.end_steps()


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Registers stages and drives jobs; holds no model weights."""

    def __init__(
        self,
        state_dir: Path,
        deadlines: Deadlines | None = None,
        security: Security | None = None,
        limits: Limits | None = None,
        metrics: Metrics | None = None,
        rendezvous: Rendezvous | None = None,
        forget_stages_after_s: float = FORGET_STAGES_AFTER_S,
    ) -> None:
        if not forget_stages_after_s > 0:
            raise InvalidArgumentError(
                f"forget_stages_after_s ({forget_stages_after_s}) must be a positive number of "
                "seconds, well above the stages' heartbeat interval"
            )
        self.state_dir = state_dir
        self.forget_stages_after_s = forget_stages_after_s
        """A stage unseen this long is forgotten (see [Note: forgetting stages])."""
        self.rendezvous = rendezvous or Rendezvous()
        """The store gradient groups of jobs with replicas meet at (see [Note: replicas])."""
        self._metrics = metrics or NO_METRICS
        self._security = security or Security()
        self._limits = limits or Limits()
        self._codec = self._limits.codec()
        self.registry = StageRegistry(security=self._security, limits=self._limits)
        self._deadlines = deadlines or Deadlines()
        self._jobs: dict[str, JobDriver] = {}
        self._lock = threading.Lock()
        self._db: StateDB | None = None
        self._streams: set[TrainStream[Any, Any, Any]] = set()
        """The Train calls running (interrupted by ``shutdown``)."""
        self._stopping = False

    def open(self) -> None:
        """Opens the state database and reads back the jobs and stages of a previous run."""
        self._db = StateDB(self.state_dir)
        for address, device, memory_bytes, models in self._db.stages():
            record = StageRecord(
                address=address, device=device, memory_bytes=memory_bytes, models=tuple(models)
            )
            self.registry.register(record)
            self.registry.mark_lost(address)  # until it registers again
        for row in self._db.open_jobs():
            job = reopen_job(
                row,
                self.registry,
                self._deadlines,
                self._storage(row.job_id),
                self._metrics,
                self.rendezvous,
            )
            self._jobs[row.job_id] = job
            self.registry.claim([s.address for s in job.plan], job.job_id)
            logger.info(
                "job %s: restored at step %d; reconciling on first use", row.job_id, row.step
            )

    def maintain_forever(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Runs ``JobDriver.maintain`` on every open job every ``interval_s`` until ``stop``."""
        while not stop.wait(interval_s):
            with self._lock:
                jobs = [j for j in self._jobs.values() if not j.closed]
            for job in jobs:
                job.maintain()
            self.forget_unseen_stages()
            self._metrics.set("registered_stages", len(self.registry.all()))
            self._metrics.set("gradient_store_keys", self.rendezvous.num_keys())

    def forget_unseen_stages(self) -> list[str]:
        """Forgets, in memory and on disk, the stages unseen for ``forget_stages_after_s``
        that no open job names (see [Note: forgetting stages] in registry.py)."""
        with self._lock:
            named = {s.address for j in self._jobs.values() if not j.closed for s in j.plan}
        gone = self.registry.forget_unseen(self.forget_stages_after_s, keep=named)
        if gone:
            logger.info(
                "forgot %d stage(s) unseen for %.0f s: %s",
                len(gone),
                self.forget_stages_after_s,
                ", ".join(gone),
            )
            if self._db is not None:
                self._db.forget_stages(gone)
        return gone

    def jobs(self) -> list[JobDriver]:
        """The jobs this coordinator drives."""
        with self._lock:
            return list(self._jobs.values())

    def _storage(self, job_id: str) -> JobStorage:
        if self._db is None:
            raise RuntimeError("CoordinatorService.open() was not called")
        return JobStorage(self._db, self.state_dir / "jobs" / job_id)

    def _job(self, job_id: str) -> JobDriver:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"job {job_id!r} does not exist")
        return job

    @handle_errors
    def RegisterStage(
        self, request: coordinator_pb2.RegisterStageRequest, context: object
    ) -> coordinator_pb2.RegisterStageResponse:
        try:
            check_stage(request.address, request.protocol, request.version)
        except FailedPreconditionError as exc:
            if self.registry.refuse(request.address, str(exc)):  # not every heartbeat
                logger.warning("refused a stage: %s", exc)
            raise
        arrived = self.registry.register(
            StageRecord(
                address=request.address,
                device=request.device,
                memory_bytes=request.memory_bytes,
                models=tuple(request.models),
            )
        )
        if arrived:
            logger.info("stage %s registered (%s)", request.address, request.device)
            if self._db is not None:
                self._db.put_stage(
                    request.address, request.device, request.memory_bytes, list(request.models)
                )
        return coordinator_pb2.RegisterStageResponse(protocol=WIRE_PROTOCOL, version=VERSION)

    @handle_errors
    def ListStages(
        self, request: coordinator_pb2.ListStagesRequest, context: object
    ) -> coordinator_pb2.ListStagesResponse:
        records = self.registry.all()
        with futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(records)))) as pool:
            health = list(pool.map(lambda r: self.registry.health(r.address, 1.0), records))
            infos = list(pool.map(self._live_info, records, health))
        return coordinator_pb2.ListStagesResponse(
            stages=[
                coordinator_pb2.StageStatus(
                    address=r.address,
                    device=r.device,
                    memory_bytes=r.memory_bytes,
                    models=r.models,
                    job_id=r.job_id,
                    start_layer=r.start_layer if r.job_id else 0,
                    end_layer=r.end_layer if r.job_id else 0,
                    rank=r.rank if r.job_id else 0,
                    health=h,
                    rss_bytes=i.rss_bytes if i else 0,
                    microbatches_per_s=i.microbatches_per_s if i else 0.0,
                )
                for r, h, i in zip(records, health, infos, strict=True)
            ]
        )

    def _live_info(self, record: StageRecord, health: Health) -> stage_pb2.StageInfo | None:
        if health == Health.UNREACHABLE:
            return None
        try:
            return self.registry.stub(record.address).Info(stage_pb2.InfoRequest(), timeout=1.0)
        except grpc.RpcError:
            return None

    @handle_errors
    def GetTrace(
        self, request: common_pb2.GetTraceRequest, context: object
    ) -> coordinator_pb2.JobTrace:
        return self._job(request.job_id).trace(request.max_runs)

    @handle_errors
    def CreateJob(
        self, request: coordinator_pb2.CreateJobRequest, context: object
    ) -> coordinator_pb2.JobInfo:
        config = config_from_proto(request.spec)
        with self._lock:
            self._check_name_free(config.name)
        remaining = getattr(context, "time_remaining", lambda: None)()
        planner.wait_for_stages(self.registry, config, request.wait_for_stages_s, remaining)
        job_id = uuid.uuid4().hex[:12]
        job = create_job(
            job_id,
            config,
            self.registry,
            self._deadlines,
            self._storage(job_id),
            self._metrics,
            self.rendezvous,
        )
        try:
            with self._lock:
                self._check_name_free(config.name)  # again: another job may have taken it
                self._jobs[job_id] = job
        except InvalidArgumentError:
            job.close()
            raise
        return job.info()

    def _check_name_free(self, name: str | None) -> None:
        """Refuses a job name an open job already has, as its name or its id (on the lock).

        Raises:
            InvalidArgumentError: the name is taken.
        """
        if name is None:
            return
        for job in self._jobs.values():
            if not job.closed and name in (job.job_id, job.config.name):
                raise InvalidArgumentError(
                    f"job name {name!r} is taken by open job {job.job_id}; choose another "
                    "name or close that job"
                )

    @handle_errors
    def GetJob(
        self, request: coordinator_pb2.GetJobRequest, context: object
    ) -> coordinator_pb2.JobInfo:
        job = self._job(request.job_id)
        job.settle()  # the stages themselves reach the step it reports
        return job.info()

    @handle_errors
    def GetModelExport(
        self, request: coordinator_pb2.GetJobRequest, context: object
    ) -> coordinator_pb2.ModelExport:
        """Asks the job's first stage to describe the model's own format (no tensors move)."""
        job = self._job(request.job_id)
        reply = call_stage(
            self.registry,
            job.plan[0],
            lambda stub: stub.Describe,
            stage_pb2.DescribeRequest(
                model=job.config.model, model_args_json=job.config.model_args_json()
            ),
            self._deadlines.control_s,
        )
        return coordinator_pb2.ModelExport(export_json=reply.export_json)

    @handle_errors
    def ListJobs(
        self, request: coordinator_pb2.ListJobsRequest, context: object
    ) -> coordinator_pb2.ListJobsResponse:
        with self._lock:
            jobs = [j for j in self._jobs.values() if not j.closed]
        return coordinator_pb2.ListJobsResponse(jobs=[j.info() for j in jobs])

    def _prepare_train(
        self,
        request: Incoming[coordinator_pb2.TrainStepRequest]
        | coordinator_pb2.TrainStepRequest
        | WireFormatError,
    ) -> _TrainCall:
        """A training request decoded (served with payload_wire's parser, see
        coordinator.server), checked and split (``JobDriver.prepare_step``); returns the step,
        to run (``JobDriver.train_prepared``) now or, in a stream, when its turn comes. Either
        part's batch errors name the batch as sent."""
        batch = train_batch(request, self._codec)
        job = self._job(batch.job_id)
        with _batch_errors(job, batch.inputs, batch.targets):
            prepared = job.prepare_step(
                batch.inputs, batch.targets, batch.side, request_id=batch.request_id
            )
        return _TrainCall(job, batch, prepared)

    @handle_errors
    def TrainStep(
        self,
        request: Incoming[coordinator_pb2.TrainStepRequest]
        | coordinator_pb2.TrainStepRequest
        | WireFormatError,
        context: object,
    ) -> coordinator_pb2.TrainStepResponse:
        return _train_reply(self._prepare_train(request)(None))

    @handle_errors
    def Train(
        self,
        request_iterator: Iterator[
            Incoming[coordinator_pb2.TrainStepRequest]
            | coordinator_pb2.TrainStepRequest
            | WireFormatError
        ],
        context: grpc.ServicerContext,
    ) -> Iterator[coordinator_pb2.TrainStepResponse]:
        """Training steps pipelined (see [Note: pipelined steps] in train_stream.py)."""
        stream: TrainStream[
            Incoming[coordinator_pb2.TrainStepRequest]
            | coordinator_pb2.TrainStepRequest
            | WireFormatError,
            tuple[JobDriver, float, int],
            coordinator_pb2.TrainStepResponse,
        ] = TrainStream(request_iterator, prepare=self._prepare_train, reply=_train_reply)
        context.add_callback(stream.stop)
        with self._lock:
            if self._stopping:
                stream.interrupt()
            self._streams.add(stream)
        try:
            if not stream.interrupted:
                yield from stream.replies()
        except Exception:
            if not stream.interrupted:
                raise  # a step's own error; one of a stopping coordinator ends as below
        finally:
            with self._lock:
                self._streams.discard(stream)
        if stream.interrupted:  # as a lost call, which the client sends again (no error class)
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(
                "the coordinator is stopping; send the unreplied steps again to its successor"
            )

    @handle_errors
    def Forward(
        self,
        request: Incoming[coordinator_pb2.ForwardRequest]
        | coordinator_pb2.ForwardRequest
        | WireFormatError,
        context: object,
    ) -> coordinator_pb2.ForwardResponse:
        batch = forward_batch(request, self._codec)
        job = self._job(batch.job_id)
        with _batch_errors(job, batch.inputs, None):
            outputs = encode(job.forward(batch.inputs, batch.side))
        return coordinator_pb2.ForwardResponse(outputs=outputs, job=job.info())

    @handle_errors
    def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.GenerateResponse]:
        if not request.HasField("input_ids"):
            raise InvalidArgumentError("generation needs input_ids")
        input_ids = decode(request.input_ids, self._codec)
        mask = (
            decode(request.attention_mask, self._codec)
            if request.HasField("attention_mask")
            else None
        )
        sampling = Sampling(
            temperature=request.temperature,
            top_k=request.top_k if request.HasField("top_k") else None,
            top_p=request.top_p if request.HasField("top_p") else None,
            seed=request.seed if request.HasField("seed") else None,
        )
        job = self._job(request.job_id)

        def on_open(leave: Callable[[], None]) -> None:
            # A client gone before its first token (a session waiting for room in the KV
            # budgets) is dropped then, not when it would have run.
            if not context.add_callback(leave):  # when the call ends, however it ends
                leave()

        steps = job.generation.generate(
            input_ids,
            request.max_new_tokens,
            sampling,
            attention_mask=mask,
            eos_token_id=request.eos_token_id if request.HasField("eos_token_id") else None,
            on_open=on_open,
        )
        try:
            for made in steps:
                yield coordinator_pb2.GenerateResponse(tokens=encode(made.tokens))
                if not context.is_active():  # the client went away: release the session
                    return
        finally:
            steps.close()

    @handle_errors
    def GetState(
        self, request: coordinator_pb2.GetJobStateRequest, context: object
    ) -> Iterator[common_pb2.TensorFrame]:
        if request.kind not in (common_pb2.PARAMETERS, common_pb2.GRADIENTS, common_pb2.CHECKPOINT):
            raise InvalidArgumentError(
                f"state kind {request.kind} must be PARAMETERS, GRADIENTS or CHECKPOINT"
            )
        yield from self._job(request.job_id).stream_state(request.kind)

    @handle_errors
    def LoadState(
        self, request_iterator: Iterable[coordinator_pb2.LoadJobStateRequest], context: object
    ) -> coordinator_pb2.LoadJobStateResponse:
        iterator = iter(request_iterator)
        first = next(iterator, None)
        if first is None:
            raise InvalidArgumentError("load_state_dict got an empty stream")
        job = self._job(first.job_id)
        step = first.step if first.HasField("step") else None

        def frames() -> Iterator[common_pb2.TensorFrame]:
            yield first.frame
            for request in iterator:
                if request.job_id != job.job_id:
                    raise InvalidArgumentError(
                        f"state stream switched from job {job.job_id!r} to {request.job_id!r}"
                    )
                yield request.frame

        return coordinator_pb2.LoadJobStateResponse(num_tensors=job.load_state(frames(), step))

    @handle_errors
    def Replan(
        self, request: coordinator_pb2.ReplanRequest, context: object
    ) -> coordinator_pb2.ReplanResponse:
        decision = self._job(request.job_id).replan(request.partition)
        return coordinator_pb2.ReplanResponse(
            plan=[s.to_proto() for s in decision.plan],
            moved=decision.moved,
            current_s=decision.current_s,
            predicted_s=decision.predicted_s,
        )

    @handle_errors
    def CloseJob(
        self, request: coordinator_pb2.CloseJobRequest, context: object
    ) -> coordinator_pb2.CloseJobResponse:
        job = self._job(request.job_id)
        job.close()
        with self._lock:
            self._jobs.pop(request.job_id, None)
        return coordinator_pb2.CloseJobResponse()

    def shutdown(self) -> None:
        """Waits for steps in flight, then closes channels; jobs stay, to resume on restart.
        Training streams start no step after this (see [Note: pipelined steps])."""
        with self._lock:
            self._stopping = True
            for stream in self._streams:
                stream.interrupt()
            jobs = list(self._jobs.values())
        for job in jobs:
            job.wait_idle()
        self.registry.close()
        self.rendezvous.close()
        if self._db is not None:
            self._db.close()
