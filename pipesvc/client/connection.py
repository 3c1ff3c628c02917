"""A connection to a coordinator: ``connect``, create and list jobs, list stages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

import grpc

from pipesvc.client.checkpoints import resume_manifest
from pipesvc.client.job import Job
from pipesvc.core.config import JobConfig, config_to_proto
from pipesvc.core.health import Health
from pipesvc.core.optim import DEFAULT_OPTIMIZER, NO_OPTIMIZER
from pipesvc.errors import PipesvcError
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc
from pipesvc.wire.diagnose import explain
from pipesvc.wire.payload_wire import FORWARD, TRAIN_STEP
from pipesvc.wire.rpc_status import rpc_errors
from pipesvc.wire.security import Security, TLSConfig
from pipesvc.wire.transport import open_channel, stream_method, unary_method

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageStatus:
    """A registered stage as the coordinator sees it."""

    address: str
    device: str
    memory_bytes: int
    models: tuple[str, ...]
    job_id: str
    start_layer: int
    end_layer: int
    rank: int
    health: Health
    rss_bytes: int = 0
    """Resident memory of the stage process."""
    microbatches_per_s: float = 0.0
    """Micro-batches computed per second over its last few runs."""


class Client:
    """A connection to a coordinator. Every method raises PipesvcError subclasses only."""

    def __init__(
        self, address: str, *, security: Security | None = None, timeout_s: float = 600.0
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.security = security or Security()
        self._channel = open_channel(address, self.security)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        service = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]
        # The calls that carry a batch, its bytes beside the message (see [Note: payload wire]).
        self._train_step = unary_method(
            self._channel,
            service.methods_by_name["TrainStep"],
            TRAIN_STEP.serialize,
            coordinator_pb2.TrainStepResponse,
        )
        self._train = stream_method(
            self._channel,
            service.methods_by_name["Train"],
            TRAIN_STEP.serialize,
            coordinator_pb2.TrainStepResponse,
        )
        self._forward = unary_method(
            self._channel,
            service.methods_by_name["Forward"],
            FORWARD.serialize,
            coordinator_pb2.ForwardResponse,
        )
        self._where = f"coordinator {address}"
        """How errors of failed calls name the coordinator."""

    def _convert(self, error: grpc.RpcError) -> PipesvcError:
        """The typed error of a failed call; a failed connection, a stage's address given for
        the coordinator's and a refused token are explained (``wire.diagnose``)."""
        return explain(
            error,
            what="coordinator",
            address=self.address,
            channel=self._channel,
            security=self.security,
        )

    def _rpc_errors(self) -> contextlib.AbstractContextManager[None]:
        """Inside, a failed call raises its typed error (``_convert``)."""
        return rpc_errors(convert=self._convert)

    @overload
    def _call(self, method: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp: ...

    @overload
    def _call(
        self, method: grpc.StreamUnaryMultiCallable[_Req, _Resp], request: Iterator[_Req]
    ) -> _Resp: ...

    def _call(self, method: Any, request: Any) -> Any:
        """Calls a method of ``self._stub`` (``self._stub.GetJob``) with this client's deadline."""
        with self._rpc_errors():
            return method(request, timeout=self.timeout_s)

    def create_job(
        self,
        *,
        model: str,
        model_args: Mapping[str, Any] | None = None,
        seed: int = 0,
        num_stages: int = 2,
        num_microbatches: int = 4,
        schedule: str = "1f1b",
        optimizer: Mapping[str, Any] | None = DEFAULT_OPTIMIZER,
        loss: str = "cross_entropy",
        partition: str = "parameters",
        rebalance: bool = False,
        clip_grad_norm: float | None = None,
        checkpoint_every: int | None = None,
        input_shape: Sequence[int] | None = None,
        input_dtype: str = "float32",
        trainable: Sequence[str] | None = None,
        wire_dtype: str | Mapping[str, str | None] | None = None,
        precision: str = "fp32",
        virtual_stages: int = 1,
        data_parallel: int = 1,
        min_replicas: int | None = None,
        resume_from: str | Path | None = None,
        wait_for_stages_s: float = 0.0,
        name: str | None = None,
        prefill_chunk: int | None = None,
        decode_steps: int | None = None,
    ) -> Job:
        """Plans and assigns a job; see JobConfig for each argument.

        ``name`` names the job where models are named: the ``model`` of the coordinator's
        OpenAI-compatible HTTP API (unique among the coordinator's open jobs).

        ``optimizer=None`` makes an inference job: it holds weights only (no gradients, no
        optimizer state, no step log) and serves ``forward``, ``generate`` and ``stream``.

        With ``wait_for_stages_s``, the coordinator first waits up to that long (and at most
        half this client's ``timeout_s``) for enough free stages that can build the model.

        With ``resume_from`` (a directory written by ``Job.save``), the job starts from that
        checkpoint's weights, optimizer state and step count; the checkpoint loads under any
        plan, but its model, model arguments and optimizer (by name; the settings are this
        call's) must match.

        Raises:
            InvalidArgumentError: a bad option (the message names it), or an unknown model.
            PlanError: not enough free stages.
        """
        config = JobConfig(
            model=model,
            model_args=dict(model_args or {}),
            seed=seed,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            optimizer=dict(optimizer) if optimizer is not None else {"name": NO_OPTIMIZER},
            loss=loss,
            partition=partition,
            rebalance=rebalance,
            clip_grad_norm=clip_grad_norm,
            checkpoint_every=checkpoint_every,
            input_shape=tuple(input_shape) if input_shape is not None else None,
            input_dtype=input_dtype,
            trainable=tuple(trainable) if trainable is not None else None,
            wire_dtype=wire_dtype,
            precision=precision,
            virtual_stages=virtual_stages,
            data_parallel=data_parallel,
            min_replicas=min_replicas,
            name=name,
            prefill_chunk=prefill_chunk,
            decode_steps=decode_steps,
        )
        return self._create(config, wait_for_stages_s=wait_for_stages_s, resume_from=resume_from)

    def _create(
        self, config: JobConfig, *, wait_for_stages_s: float, resume_from: str | Path | None
    ) -> Job:
        """Creates the job ``config`` describes on the coordinator, started from the checkpoint
        in ``resume_from`` when given (checked against ``config`` before the job is created;
        a job whose checkpoint then fails to load is closed)."""
        manifest = resume_manifest(resume_from, config) if resume_from is not None else None
        info = self._call(
            self._stub.CreateJob,
            coordinator_pb2.CreateJobRequest(
                spec=config_to_proto(config), wait_for_stages_s=wait_for_stages_s
            ),
        )
        job = Job(self, info)
        if manifest is not None and resume_from is not None:
            try:
                job._load_checkpoint(Path(resume_from), manifest)
            except BaseException:
                job.close()
                raise
        return job

    def get_job(self, job_id: str) -> Job:
        """A handle on an existing job.

        Raises:
            NotFoundError: no such job.
        """
        return Job(
            self, self._call(self._stub.GetJob, coordinator_pb2.GetJobRequest(job_id=job_id))
        )

    def jobs(self) -> list[Job]:
        """Every open job, oldest first; ``job.close()`` on one frees its stages."""
        reply = self._call(self._stub.ListJobs, coordinator_pb2.ListJobsRequest())
        return [Job(self, info) for info in reply.jobs]

    def stages(self) -> list[StageStatus]:
        """Every registered stage with its health and assignment."""
        reply = self._call(self._stub.ListStages, coordinator_pb2.ListStagesRequest())
        return [
            StageStatus(
                address=s.address,
                device=s.device,
                memory_bytes=s.memory_bytes,
                models=tuple(s.models),
                job_id=s.job_id,
                start_layer=s.start_layer,
                end_layer=s.end_layer,
                rank=s.rank,
                health=Health.from_wire(s.health),
                rss_bytes=s.rss_bytes,
                microbatches_per_s=s.microbatches_per_s,
            )
            for s in reply.stages
        ]

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str,
    *,
    token: str | None = None,
    tls: TLSConfig | bool | None = None,
    timeout_s: float = 600.0,
) -> Client:
    """A client for the coordinator at ``address`` (``host:port``).

    Nothing is sent yet. If the first call cannot reach a coordinator there, it raises
    StageUnavailableError naming the likely cause and what to check (address and port, TLS on
    one side only, the CA, a client certificate), or WrongServiceError when the address is a
    stage's; a refused token raises UnauthenticatedError saying to check it.

    Args:
        address: the coordinator's ``host:port``.
        token: the cluster's shared token, when it runs with ``--token-file``.
        tls: a TLSConfig (CA to verify the coordinator; a certificate and key for mutual TLS),
            or True for TLS verified against the system's CAs.
        timeout_s: deadline of each call.

    Raises:
        InvalidArgumentError: a bad token or TLS material.
    """
    tls_config = TLSConfig() if tls is True else (tls or None)
    return Client(address, security=Security(token=token, tls=tls_config), timeout_s=timeout_s)
