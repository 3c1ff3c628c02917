"""The Python client: ``connect`` to a coordinator, create jobs, train and run them.

Usage::

    import pipesvc
    with pipesvc.LocalCluster(num_stages=2) as cluster:
        client = pipesvc.connect(cluster.address)
        job = client.create_job(model="mlp", num_stages=2, loss="mse")
        loss = job.train_step(inputs, targets)
        job.close()
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar, cast, overload

import grpc
import torch

from pipesvc.core.config import JobConfig, config_from_proto, config_to_dict, config_to_proto
from pipesvc.core.health import Health
from pipesvc.core.limits import parse_bytes
from pipesvc.core.link_codecs import Link, links
from pipesvc.core.optim import DEFAULT_OPTIMIZER, NO_OPTIMIZER
from pipesvc.core.plan import PipelineStage, plan_to_dicts
from pipesvc.core.tensor_codec import decode, encode, named_frames, read_named_frames
from pipesvc.errors import FailedPreconditionError, InvalidArgumentError, PipesvcError
from pipesvc.observe.trace import StageTimeline, TraceEvent, write_trace_files
from pipesvc.storage.checkpoint import (
    Manifest,
    read_layers,
    read_manifest,
    verify,
    write_checkpoint,
)
from pipesvc.storage.publish import check_target
from pipesvc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from pipesvc.wire.diagnose import explain
from pipesvc.wire.payload_wire import FORWARD, TRAIN_STEP, Outgoing, Payloads
from pipesvc.wire.rpc_status import ERROR_CLASS_KEY, rpc_errors
from pipesvc.wire.security import Security, TLSConfig
from pipesvc.wire.step_stream import StepStream
from pipesvc.wire.transport import open_channel, stream_method, unary_method

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

TRAIN_STEP_RETRIES = 6
"""Times ``Job.train_step`` sends a step again, under the same request id, after its call
failed in transport (the coordinator restarting, a dropped connection): over about 30 s, and
within the client's ``timeout_s`` from the first try."""
RETRY_PAUSE_S = 0.5
"""Pause before the first such retry; doubles with each."""


def _lost_in_transport(error: grpc.RpcError) -> bool:
    """The call failed with UNAVAILABLE and no error of the coordinator's own: it went away
    or the connection dropped, and the step may have run with its reply lost."""
    if not hasattr(error, "code") or error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    entries = cast("Iterable[tuple[str, str | bytes]]", trailing or ())
    return not any(key == ERROR_CLASS_KEY for key, _ in entries)


def _own_deadline(error: grpc.RpcError) -> bool:
    """The call reached its own deadline (not a deadline error of the coordinator's)."""
    if not hasattr(error, "code") or error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    entries = cast("Iterable[tuple[str, str | bytes]]", trailing or ())
    return not any(key == ERROR_CLASS_KEY for key, _ in entries)


def _with_progress(losses: Iterator[float], total: int | None) -> Iterator[float]:
    """``losses`` under a tqdm progress bar showing the latest one."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=total, unit="step")
    try:
        for loss in losses:
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            bar.update(1)
            yield loss
    finally:
        bar.close()
        if hasattr(losses, "close"):
            losses.close()


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Replan:
    """What ``Job.replan`` did."""

    plan: list[PipelineStage]
    """The plan now (the old one when nothing moved)."""
    moved: bool
    current_s: list[float]
    """``throughput``: each rank's predicted seconds per micro-batch on the plan before."""
    predicted_s: list[float]
    """``throughput``: the same on the plan chosen."""


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
        plan, but its model, model arguments and optimizer must match.

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
        )
        manifest = read_manifest(resume_from) if resume_from is not None else None
        if manifest is not None and resume_from is not None:
            verify(resume_from, manifest)
            saved = manifest.spec
            for key in ("model", "model_args"):
                if saved.get(key) != config_to_dict(config)[key]:
                    raise InvalidArgumentError(
                        f"checkpoint {str(resume_from)!r} is of {key} {saved.get(key)!r}; "
                        f"the job asks for {config_to_dict(config)[key]!r}"
                    )
            if dict(saved.get("optimizer", {})).get("name") != config.optimizer.get("name"):
                raise InvalidArgumentError(
                    f"checkpoint {str(resume_from)!r} holds {saved['optimizer']['name']!r} "
                    f"optimizer state; the job asks for {config.optimizer.get('name')!r}"
                )
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


def _side_inputs(
    attention_mask: torch.Tensor | None, payloads: Payloads
) -> dict[str, common_pb2.Tensor]:
    """A request's side inputs (see [Note: side inputs] in ``pipesvc.core.microbatch``)."""
    return {} if attention_mask is None else {"attention_mask": payloads.tensor(attention_mask)}


def _train_request(
    job_id: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    attention_mask: torch.Tensor | None,
    request_id: str,
) -> Outgoing[coordinator_pb2.TrainStepRequest]:
    """A training step's request, its tensors' bytes beside the message (see [Note: payload
    wire]): send with ``TRAIN_STEP.serialize``. The tensors are viewed, not copied, and must
    not change until it is sent (every try of it)."""
    payloads = Payloads()
    message = coordinator_pb2.TrainStepRequest(
        job_id=job_id,
        inputs=payloads.tensor(inputs),
        targets=payloads.tensor(targets),
        side_inputs=_side_inputs(attention_mask, payloads),
        request_id=request_id,
    )
    return TRAIN_STEP.outgoing(message, payloads)


class Job:
    """A job on the cluster: train it, run it, read and write its weights."""

    def __init__(self, client: Client, info: coordinator_pb2.JobInfo) -> None:
        self._client = client
        self.id: str = info.job_id
        self.config: JobConfig = config_from_proto(info.spec)
        """As the coordinator has it (``replan`` changes the partition)."""
        self.num_layers: int = info.num_layers
        self.plan: list[PipelineStage] = []
        """Which stage holds which layers (as of the last reply about this job)."""
        self.plan_epoch: int = 0
        """Bumped by the coordinator each time the plan changes."""
        self.step: int = 0
        """Committed steps."""
        self.recoveries: int = 0
        """Times the job recovered from a lost stage."""
        self.checkpoint_step: int = 0
        """Step of the newest durable checkpoint, the one recovery restores (a checkpoint
        still streaming in the background shows once it is on disk)."""
        self._update(info)

    def _update(self, info: coordinator_pb2.JobInfo) -> None:
        """Takes the plan, step, recovery count and configuration from a reply that carries
        the job.

        [Note: fresh handle] Every reply about a job (create, get, train_step, forward)
        carries its JobInfo, so a recovery during a call shows in ``plan`` and
        ``recoveries`` as soon as that call returns; ``refresh()`` is only needed to see
        what other clients did since.
        """
        self.config = config_from_proto(info.spec)
        self.plan = [PipelineStage.from_proto(s) for s in info.plan]
        self.plan_epoch = info.plan_epoch
        self.step = info.step
        self.recoveries = info.recoveries
        self.checkpoint_step = info.checkpoint_step

    @property
    def links(self) -> list[Link]:
        """Each link between the stages of replica 0, in rank order, with the codecs its
        activations and gradients cross in: the job's ``wire_dtype`` between hosts, exact on
        one host (see [Note: codecs per link] in ``pipesvc.core.link_codecs``); under
        ``wire_dtype="auto"``, what the plan fixed for the link and why (``Link.reason``, see
        [Note: automatic codecs])."""
        return links(self.config, [s for s in self.plan if s.replica == 0])

    def __repr__(self) -> str:
        ranges = ", ".join(
            f"[{s.start_layer}, {s.end_layer}) at {s.address}"
            + (f" (replica {s.replica})" if self.config.data_parallel > 1 else "")
            + (f" (chunk {s.chunk})" if self.config.virtual_stages > 1 else "")
            for s in self.plan
        )
        ranks = len({s.rank for s in self.plan})
        described = [link.describe(ranks) for link in self.links]
        return (
            f"Job(id={self.id!r}, model={self.config.model!r}, step={self.step}, "
            f"schedule={self.config.schedule!r}, num_microbatches={self.config.num_microbatches}, "
            f"plan=[{ranges}], recoveries={self.recoveries}"
            + (f", links=[{'; '.join(described)}]" if self.config.wire_dtype else "")
            + ")"
        )

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        request_id: str | None = None,
    ) -> float:
        """One optimizer step on the mini-batch; returns its mean loss.

        The step commits on every stage or on none. ``attention_mask`` (Hugging Face models:
        shaped like the token ids, 1 for a token and 0 for padding, bool or integer) is split
        with the batch and applied by every block, as ``model(ids, attention_mask=...)`` does.

        The step is sent with a request id (``request_id``, or a new random one), and sent
        again under it if the coordinator could not be reached (it restarted, or the
        connection dropped): the coordinator applies a step once per id and answers a repeat
        with the first result. A caller that retries a failed ``train_step`` itself passes the
        same ``request_id`` to get the same guarantee.

        Raises:
            InvalidArgumentError: the batch does not fit the model or the job, or the request
                id was used for another batch.
            StepAbortedError: the step was aborted on every stage (nothing committed).
            PipesvcError: recovery was impossible (no stage or memory left). If the step failed
                before its commit began, nothing changed; if it failed during the commit, the
                step is in the step log and the job's next call completes it on every stage.
        """
        request = self._train_request(inputs, targets, attention_mask, request_id)
        client = self._client
        deadline = time.monotonic() + client.timeout_s
        for attempt in range(TRAIN_STEP_RETRIES + 1):
            try:
                with client._rpc_errors():
                    reply = client._train_step(
                        request, timeout=max(deadline - time.monotonic(), 0.0)
                    )
                break
            except PipesvcError as exc:
                pause = RETRY_PAUSE_S * 2**attempt
                cause = exc.__cause__
                lost = isinstance(cause, grpc.RpcError) and _lost_in_transport(cause)
                last = attempt == TRAIN_STEP_RETRIES
                if last or not lost or time.monotonic() + pause >= deadline:
                    raise
            time.sleep(pause)
        if reply.HasField("job"):
            self._update(reply.job)
        else:  # a coordinator from before replies carried the job
            self.step = reply.step
        return float(reply.loss)

    def _train_request(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None,
        request_id: str | None,
    ) -> Outgoing[coordinator_pb2.TrainStepRequest]:
        """A training step's request (the one place a step's tensors are encoded, their bytes
        beside the message), under ``request_id`` or a new random one."""
        return _train_request(
            self.id, inputs, targets, attention_mask, request_id or uuid.uuid4().hex
        )

    def _batch_request(self, batch: Any) -> Outgoing[coordinator_pb2.TrainStepRequest]:
        """The request of one of ``train``'s batches: an ``(inputs, targets)`` pair, or a
        mapping with ``inputs``, ``targets`` and optionally ``attention_mask``.

        Raises:
            InvalidArgumentError: the batch is neither, or holds something not a tensor.
        """
        if isinstance(batch, Mapping):
            unknown = sorted(set(batch) - {"inputs", "targets", "attention_mask"})
            if unknown or "inputs" not in batch or "targets" not in batch:
                raise InvalidArgumentError(
                    f"a batch given as a mapping has keys {sorted(batch)}; expected 'inputs', "
                    "'targets' and optionally 'attention_mask'"
                )
            parts = (batch["inputs"], batch["targets"], batch.get("attention_mask"))
        elif isinstance(batch, tuple | list) and len(batch) == 2:
            parts = (batch[0], batch[1], None)
        else:
            raise InvalidArgumentError(
                f"a batch is an (inputs, targets) pair or a mapping with 'inputs' and "
                f"'targets'; got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            )
        for name, tensor in zip(("inputs", "targets", "attention_mask"), parts, strict=True):
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise InvalidArgumentError(
                    f"a batch's {name} is a {type(tensor).__name__}; expected a torch.Tensor"
                )
        return self._train_request(parts[0], parts[1], parts[2], None)

    def train(
        self, batches: Iterable[Any], *, steps: int | None = None, progress: bool = False
    ) -> Iterator[float]:
        """Trains on each of ``batches`` in turn, pipelined; yields each step's loss, in order,
        as the step commits.

        A batch is an ``(inputs, targets)`` pair as ``train_step`` takes them, or a mapping
        with ``inputs``, ``targets`` and optionally ``attention_mask``. Batches are read on a
        background thread and sent ahead (at most ``TRAIN_WINDOW`` without a reply), so the
        coordinator holds the next step when one is decided and starts it at once (see [Note:
        pipelined steps] in ``pipesvc/coordinator/train_stream.py``); the losses, weights and
        guarantees are ``train_step``'s, step by step: each step commits on every stage or on
        none, under a request id of its own, and one whose reply was lost to a coordinator
        restart or a dropped connection is sent again under it (see [Note: stream
        reconnect] in ``pipesvc/wire/step_stream.py``).

        ``steps``: stop after that many steps (None: when ``batches`` runs out). ``progress``:
        show a tqdm progress bar with the latest loss.

        Stopping early (``break`` out of a ``for`` over it, or ``close()``) sends nothing more:
        the steps already sent (at most ``TRAIN_WINDOW``) finish, each committing whole, and
        count in ``job.step``; no step of the stream starts after that, so the next call sees
        the job as the stream left it.

        Raises (when the failed step's turn comes, after the losses of the steps before it;
        no later step runs):
            InvalidArgumentError: a batch is malformed or does not fit the model or the job.
            StepAbortedError, PipesvcError: as ``train_step``.
        """
        if steps is not None and steps < 0:
            raise InvalidArgumentError(f"steps={steps}; expected a count of steps >= 0, or None")
        source: Iterator[Any] = iter(batches) if steps is None else islice(batches, steps)
        client = self._client

        def on_reply(reply: coordinator_pb2.TrainStepResponse) -> None:
            self._update(reply.job)
            self.step = reply.step  # the job may be a step further already

        def retryable(error: grpc.RpcError, progressed: bool) -> bool:
            return _lost_in_transport(error) or (progressed and _own_deadline(error))

        stream = StepStream(
            source,
            make_request=self._batch_request,
            open_call=lambda requests: client._train(requests, timeout=client.timeout_s),
            on_reply=on_reply,
            convert=client._convert,
            retryable=retryable,
            retries=TRAIN_STEP_RETRIES,
            pause_s=RETRY_PAUSE_S,
        )
        if not progress:
            return iter(stream)
        total = steps
        if isinstance(batches, Sized):
            total = len(batches) if steps is None else min(steps, len(batches))
        return _with_progress(iter(stream), total)

    def refresh(self) -> Job:
        """Re-reads the job's plan, step and recovery count (to see other clients' calls)."""
        self._update(
            self._client._call(
                self._client._stub.GetJob, coordinator_pb2.GetJobRequest(job_id=self.id)
            )
        )
        return self

    def forward(
        self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model's output on ``inputs`` (with the padding ``attention_mask``, as in
        ``train_step``), computed through the pipeline.

        Raises:
            InvalidArgumentError: the batch does not fit the model.
        """
        payloads = Payloads()
        message = coordinator_pb2.ForwardRequest(
            job_id=self.id,
            inputs=payloads.tensor(inputs),
            side_inputs=_side_inputs(attention_mask, payloads),
        )
        reply = self._client._call(self._client._forward, FORWARD.outgoing(message, payloads))
        if reply.HasField("job"):
            self._update(reply.job)
        return decode(reply.outputs)

    def stream(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yields each generation step's new token of every row (``[batch]``) as it is made;
        the arguments are ``generate``'s. Closing the iterator early ends the session and
        frees its caches on every stage.

        Raises:
            InvalidArgumentError: the prompt, mask or settings do not fit (before any token).
            ResourceExhaustedError: a stage's KV budget would be exceeded.
        """
        request = coordinator_pb2.GenerateRequest(
            job_id=self.id,
            input_ids=encode(input_ids),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
        )
        if attention_mask is not None:
            request.attention_mask.CopyFrom(encode(attention_mask))
        with self._client._rpc_errors():
            replies = self._client._stub.Generate(request, timeout=self._client.timeout_s)
            try:
                for reply in replies:
                    yield decode(reply.tokens)
            finally:
                replies.cancel()

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prompt followed by up to ``max_new_tokens`` new tokens per row, like
        ``transformers``' ``generate``: ``temperature=0.0`` picks the most likely token
        (``do_sample=False``); above 0 it samples, after ``top_k`` and ``top_p`` filtering,
        reproducibly for a given ``seed``. A batch may be left-padded to one length with an
        ``attention_mask``. Generation ends early once every row has produced
        ``eos_token_id`` (rows that finished first get it again). Each stage keeps the keys
        and values of its own layers per session, so a new token costs one position through
        the pipeline; the job's last committed weights are used, between training steps.

        Raises:
            InvalidArgumentError: the prompt, mask or settings do not fit.
            ResourceExhaustedError: a stage's KV budget would be exceeded.
        """
        steps = self.stream(
            input_ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
            attention_mask=attention_mask,
        )
        new = [tokens[:, None] for tokens in steps]
        return torch.cat([input_ids.to(torch.long), *new], dim=1)

    def _read_state(self, kind: common_pb2.StateKind.ValueType) -> dict[str, torch.Tensor]:
        request = coordinator_pb2.GetJobStateRequest(job_id=self.id, kind=kind)
        with self._client._rpc_errors():
            stream = self._client._stub.GetState(request, timeout=self._client.timeout_s)
            return dict(read_named_frames(stream))

    def model_export(self) -> dict[str, Any] | None:
        """How the job's model maps to its own format, or None for pipesvc's own models
        (asked once, then kept: it depends only on the model and its arguments)."""
        if not hasattr(self, "_export"):
            reply = self._client._call(
                self._client._stub.GetModelExport, coordinator_pb2.GetJobRequest(job_id=self.id)
            )
            self._export: dict[str, Any] | None = (
                json.loads(reply.export_json) if reply.export_json else None
            )
        return self._export

    def _own_keys(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        export = self.model_export()
        keys = export.get("keys") if export else None
        return {keys.get(k, k): v for k, v in state.items()} if keys else state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors (streamed from the stages): under ``build(...)``'s keys,
        or for a Hugging Face model under the keys of its own ``state_dict()``."""
        return self._own_keys(self._read_state(common_pb2.PARAMETERS))

    def gradients(self) -> dict[str, torch.Tensor]:
        """The gradients of the last committed step (after clipping), keyed as ``state_dict``."""
        return self._own_keys(self._read_state(common_pb2.GRADIENTS))

    def save_pretrained(
        self,
        directory: str | Path,
        *,
        merged: bool = False,
        max_shard_size: str = "5GB",
        dtype: str | torch.dtype | None = None,
    ) -> None:
        """Writes a Hugging Face model's job as a directory ``transformers`` loads with
        ``AutoModelForCausalLM.from_pretrained`` (see [Note: Hugging Face export]). With LoRA
        it writes peft's adapter directory (``PeftModel.from_pretrained`` on the original
        model), or with ``merged=True`` the model with the adapters merged in.

        ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"`` or the torch dtype): what the
        weights are written in; by default the dtype the original checkpoint is stored in,
        whatever the job's precision. Adapters are written as trained unless it is given.

        Files of the same names in an existing ``directory`` are overwritten, others are kept
        (see [Note: saving beside] in ``pipesvc.storage.publish``).

        Raises:
            FailedPreconditionError: the job's model is not a Hugging Face model (use ``save``),
                or ``directory`` holds weight files pipesvc did not write that this save would
                leave stale.
            InvalidArgumentError: a bad ``max_shard_size`` or ``dtype``, or ``directory`` is
                not a directory.
        """
        from pipesvc.models.hf_export import (
            DTYPES,
            dtype_name,
            merge_adapters,
            split_adapters,
            write_adapter,
            write_model,
        )

        export = self.model_export()
        if not export or export.get("format") != "huggingface":
            raise FailedPreconditionError(
                f"job {self.id}'s model {self.config.model!r} is not a Hugging Face model; "
                "save it with job.save(path)"
            )
        shard_bytes = parse_bytes(max_shard_size)
        chosen = dtype_name(dtype) if dtype is not None else None
        check_target(directory)  # before reading the whole state
        state, lora = self.state_dict(), export.get("lora")
        if lora and not merged:
            _, adapters = split_adapters(state)
            if chosen is not None:
                adapters = {k: v.to(DTYPES[chosen]) for k, v in adapters.items()}
            write_adapter(adapters, lora, directory, base_model=str(export.get("source", "")))
            return
        if lora:
            state = merge_adapters(state, lora)
        write_model(
            state,
            export["config"],
            directory,
            embed_key=export["embed_key"],
            head_key=export["head_key"],
            max_shard_bytes=shard_bytes,
            # stages of an older release send no "dtype": then the config's is the default
            dtype=chosen or export.get("dtype"),
            layout=export.get("layout"),
        )

    def timelines(self, max_runs: int = 0) -> list[StageTimeline]:
        """Every stage's timed actions of the job's newest ``max_runs`` runs (0: all kept)."""
        reply = self._client._call(
            self._client._stub.GetTrace,
            common_pb2.GetTraceRequest(job_id=self.id, max_runs=max_runs),
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

    def trace(self, path: str | Path, max_runs: int = 5) -> tuple[Path, Path]:
        """Writes the newest runs as Chrome trace JSON (open it in Perfetto) and a PNG timeline.

        ``path`` is the stem: ``path.json`` and ``path.png`` are written and returned.
        """
        stem = Path(path)
        if stem.suffix in (".json", ".png"):
            stem = stem.with_suffix("")
        c = self.config
        title = (
            f"job {self.id}: {c.model}, {c.schedule}, {len(self.plan)} stages x "
            f"{c.num_microbatches} micro-batches"
        )
        return write_trace_files(self.timelines(max_runs), stem, title=title)

    def save(self, path: str | Path) -> None:
        """Writes a checkpoint (weights, optimizer state, step) to the directory ``path``.

        It loads with ``client.create_job(..., resume_from=path)``, under any plan. Write it
        while no other client is training this job. Into an existing directory it overwrites
        only a checkpoint's files (see [Note: saving beside] in ``pipesvc.storage.publish``).

        Raises:
            InvalidArgumentError: ``path`` exists and is not a directory.
            FailedPreconditionError: ``path`` holds layer files pipesvc did not write that this
                checkpoint would leave stale.
        """
        check_target(path)  # before the state streams
        self.refresh()
        request = coordinator_pb2.GetJobStateRequest(job_id=self.id, kind=common_pb2.CHECKPOINT)
        with self._client._rpc_errors():
            stream = self._client._stub.GetState(request, timeout=self._client.timeout_s)
            write_checkpoint(
                path,
                read_named_frames(stream),
                job_id=self.id,
                step=self.step,
                spec=config_to_dict(self.config),
                num_layers=self.num_layers,
                plan=plan_to_dicts(self.plan),
            )

    def _load_checkpoint(self, path: Path, manifest: Manifest) -> None:
        def requests() -> Iterator[coordinator_pb2.LoadJobStateRequest]:
            first = True
            layers = read_layers(path, manifest, 0, manifest.num_layers, check_digests=False)
            for name, tensor in layers:
                for frame in named_frames(name, tensor):
                    request = coordinator_pb2.LoadJobStateRequest(job_id=self.id, frame=frame)
                    if first:
                        request.step = manifest.step
                        first = False
                    yield request

        self._client._call(self._client._stub.LoadState, requests())
        self.step = manifest.step

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Loads a full state_dict (keyed as ``state_dict`` returns it) into the stages; all
        apply it or none does.

        Raises:
            InvalidArgumentError: missing or unexpected keys, or a shape or dtype mismatch.
        """
        export = self.model_export()
        if export and export.get("keys"):
            ours = {own: key for key, own in export["keys"].items()}
            state_dict = {ours.get(k, k): v for k, v in state_dict.items()}

        def requests() -> Iterator[coordinator_pb2.LoadJobStateRequest]:
            for name, tensor in state_dict.items():
                for frame in named_frames(name, tensor):
                    yield coordinator_pb2.LoadJobStateRequest(job_id=self.id, frame=frame)

        self._client._call(self._client._stub.LoadState, requests())

    def replan(self, partition: str = "throughput") -> Replan:
        """Moves the job's layers to the plan ``partition`` gives, between two steps, with
        their optimizer state; the next step continues from exactly the same state.
        ``"throughput"`` measures the stages (their timings of the steps so far and a short
        calibration) and takes the plan predicted fastest, if it beats the current one.

        Raises:
            InvalidArgumentError: an unknown partition method.
            FailedPreconditionError: ``"throughput"`` before the job trained a step on its
                current plan.
            ResourceExhaustedError: the method's plan does not fit the stages' memory.
        """
        reply = self._client._call(
            self._client._stub.Replan,
            coordinator_pb2.ReplanRequest(job_id=self.id, partition=partition),
        )
        self.plan = [PipelineStage.from_proto(s) for s in reply.plan]
        self.refresh()  # the partition the job now plans with
        return Replan(
            plan=list(self.plan),
            moved=reply.moved,
            current_s=list(reply.current_s),
            predicted_s=list(reply.predicted_s),
        )

    def close(self) -> None:
        """Frees the job's stages."""
        self._client._call(
            self._client._stub.CloseJob, coordinator_pb2.CloseJobRequest(job_id=self.id)
        )

    def __enter__(self) -> Job:
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
