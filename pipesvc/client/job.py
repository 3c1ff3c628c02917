"""A job on the cluster, as the client holds it: train it, run it, read and write its weights.
Training's requests and retries, checkpoint files, Hugging Face export and traces live in
modules of their own beside this one; ``Job``'s methods are the API and say what each does."""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipesvc.client import checkpoints, export, traces
from pipesvc.client.training import send_step, side_inputs, stream_steps, train_request
from pipesvc.core.config import JobConfig, config_from_proto
from pipesvc.core.link_codecs import Link, links
from pipesvc.core.plan import PipelineStage
from pipesvc.core.tensor_codec import decode, encode, named_frames, read_named_frames
from pipesvc.observe.trace import StageTimeline
from pipesvc.storage.checkpoint import Manifest
from pipesvc.v1 import common_pb2, coordinator_pb2
from pipesvc.wire.payload_wire import FORWARD, Payloads

if TYPE_CHECKING:
    from pipesvc.client.connection import Client


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


class Job:
    """A job on the cluster: train it, run it, read and write its weights."""

    def __init__(self, client: Client, info: coordinator_pb2.JobInfo) -> None:
        self._client = client
        self._seen = coordinator_pb2.JobInfo()
        """The newest description of the job read (``_update``)."""
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
        # A stream of steps brings the job with every step: read only what changed.
        if info.spec != self._seen.spec:
            self.config = config_from_proto(info.spec)
        if info.plan != self._seen.plan:
            self.plan = [PipelineStage.from_proto(s) for s in info.plan]
        # Kept as it came, never copied into one message kept for good: protobuf's upb runtime
        # copies into the kept message's arena, which frees nothing until the message goes, so
        # a CopyFrom per step grew the client by ~0.5 KiB a step (~0.5 GiB a million steps).
        self._seen = info
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
        request = train_request(
            self.id, inputs, targets, attention_mask, request_id or uuid.uuid4().hex
        )
        reply = send_step(self._client, request)
        if reply.HasField("job"):
            self._update(reply.job)
        else:  # a coordinator from before replies carried the job
            self.step = reply.step
        return float(reply.loss)

    def train(
        self, batches: Iterable[Any], *, steps: int | None = None, progress: bool = False
    ) -> Generator[float, None, None]:
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

        def on_reply(reply: coordinator_pb2.TrainStepResponse) -> None:
            self._update(reply.job)
            self.step = reply.step  # the job may be a step further already

        return stream_steps(
            self._client, self.id, batches, steps=steps, progress=progress, on_reply=on_reply
        )

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
            side_inputs=side_inputs(attention_mask, payloads),
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

        Files of the same names in an existing ``directory`` are overwritten and others are
        kept, except weight and index files an earlier pipesvc save left that this one does
        not rewrite, which are deleted (see [Note: saving beside] in
        ``pipesvc.storage.publish``).

        Raises:
            FailedPreconditionError: the job's model is not a Hugging Face model (use ``save``),
                or ``directory`` holds weight files pipesvc did not write that this save would
                leave stale.
            InvalidArgumentError: a bad ``max_shard_size`` or ``dtype``, or ``directory`` is
                not a directory.
        """
        export.save_pretrained(
            self, directory, merged=merged, max_shard_size=max_shard_size, dtype=dtype
        )

    def timelines(self, max_runs: int = 0) -> list[StageTimeline]:
        """Every stage's timed actions of the job's newest ``max_runs`` runs (0: all kept)."""
        return traces.timelines(self, max_runs)

    def trace(self, path: str | Path, max_runs: int = 5) -> tuple[Path, Path]:
        """Writes the newest runs as Chrome trace JSON (open it in Perfetto) and a PNG timeline.

        ``path`` is the stem: ``path.json`` and ``path.png`` are written and returned.
        """
        return traces.trace(self, path, max_runs)

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
        checkpoints.save(self, path)

    def _load_checkpoint(self, path: Path, manifest: Manifest) -> None:
        """Loads the checkpoint at ``path`` into the stages (``resume_from``, tests)."""
        checkpoints.load_checkpoint(self, path, manifest)

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
