"""The stage servicer: a thin adapter from StageService RPCs to the step engine and the links.

It decodes and checks requests, holds at most one job (``Assignment``: its step engine and its
links to the neighbours) and delegates runs, commits and aborts to ``StepEngine``
(pipesvc.stage.compute.engine), which has no gRPC in it. Its state RPCs (``StateRpcs`` in
state_rpcs.py) and telemetry RPCs (``TelemetryRpcs`` in telemetry_rpcs.py) are mixed in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from concurrent import futures

import grpc
import torch

from pipesvc import models
from pipesvc.core.config import JobConfig, parse_json_object
from pipesvc.core.limits import MAX_MICROBATCHES
from pipesvc.core.microbatch import MicrobatchCaches
from pipesvc.core.tensor_codec import decode, encode, named_frames
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PipesvcError,
    StepAbortedError,
    WireFormatError,
)
from pipesvc.stage.assignment import Assignment, check_assign
from pipesvc.stage.collective.replica_group import GroupSpec
from pipesvc.stage.compute.engine import RunInputs
from pipesvc.stage.control import ControlServer
from pipesvc.stage.dataplane.frame_wire import OutFrame
from pipesvc.stage.dataplane.malloc import give_back
from pipesvc.stage.net import probe
from pipesvc.stage.net.links import UpstreamLink
from pipesvc.stage.options import StageOptions
from pipesvc.stage.run_request import cache_refs, carried_commit, decode_steps, step_sampling
from pipesvc.stage.state_rpcs import StateRpcs
from pipesvc.stage.telemetry_rpcs import TelemetryRpcs
from pipesvc.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from pipesvc.wire.control_wire import Reply, Unreadable, failed, ok
from pipesvc.wire.payload_wire import RUN_STEP, Incoming
from pipesvc.wire.rpc_status import abort_with, handle_errors, to_pipesvc
from pipesvc.wire.transport import open_channel, split_address

__all__ = ["StageOptions", "StageService"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """Runs the block with ``count`` torch intra-op threads on this thread (0: as it is).

    [Note: generation threads] In a training run every stage computes at once, so stages that
    share a host split its cores (``--threads``; ``LocalCluster`` gives each its share). A
    generation step is one position through the pipeline: the stages compute one after
    another, each idle while the others work, so a stage that keeps its share leaves the rest
    of the host's cores idle. ``--generate-threads`` gives a generation run of one micro-batch
    more (``LocalCluster`` gives it every core): on the 2-core machine of ``bench/README.md``
    16 sessions on 2 stages made about 30% more tokens a second with 2 threads than with 1.
    So does a run whose micro-batches all but one add a position a row (new prompts beside the
    others' decode steps): the wide one dominates, and it goes through the stages one after
    another like a decode step (``in_turn``). On the same machine, of 16 sessions on 2 stages
    the 15 whose prompts ran beside the first session's decode step got their first tokens at
    210-240 ms instead of 320-350. A run of several wide micro-batches (a prompt's chunks,
    prompts that each keep a prefix) pipelines them, so its stages compute at once and keep
    their share: with every core, a 2048-token prompt's chunks through 4 stages took 3.1 s
    instead of 1.3. OpenMP's thread count is per thread (see ``_same_threads`` in
    ``pipesvc.stage.server``), so the run's own thread sets it and puts it back, and other
    runs keep theirs.
    """
    before = torch.get_num_threads()
    if not count or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_turn(caches: list[MicrobatchCaches], m: int) -> bool:
    """Whether a generation run's ``m`` micro-batches go through the stages one after another
    rather than pipelined: one micro-batch, or all but one of them adding one position a row
    (see [Note: generation threads]); a run without caches, only with one micro-batch."""
    if not caches:
        return m == 1
    return sum(1 for refs in caches if any(ref.positions > 1 for ref in refs)) <= 1


CONTROL_WORKERS = 16
"""Threads that handle Control streams' messages, over every stream of the stage."""


@functools.lru_cache(maxsize=8)
def _layer_bytes(model: str, model_args_json: str) -> tuple[int, ...]:
    """Each layer's weight bytes, described on the meta device (no memory used)."""
    described = models.describe(model, parse_json_object(model_args_json, "model_args_json"))
    return tuple(int(layer.parameter_bytes) for layer in described.layers)


class StageService(StateRpcs, TelemetryRpcs, stage_pb2_grpc.StageServiceServicer):
    """Serves one stage; holds at most one job's layers at a time."""

    def __init__(self, options: StageOptions) -> None:
        self._options = options
        self._codec = options.limits.codec()
        self._lock = threading.Lock()
        self._job: Assignment | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._control_opened = 0
        self._control_open = 0
        threads = torch.get_num_threads()
        self._control_pool = futures.ThreadPoolExecutor(
            max_workers=CONTROL_WORKERS,
            thread_name_prefix="control",
            # As the server's request threads (see stage.server._same_threads): a run computes
            # here with the process's torch thread count.
            initializer=lambda: torch.set_num_threads(threads),
        )

    def advertise(self, address: str, coordinator_host: str) -> None:
        """The address neighbours and the coordinator dial, and the coordinator's host, once
        the server is bound (before it registers, so before any request names them)."""
        self._options = dataclasses.replace(
            self._options, address=address, coordinator_host=coordinator_host
        )

    @property
    def holds_job(self) -> bool:
        """Whether a job is assigned to this stage."""
        with self._lock:
            return self._job is not None

    # -- helpers -----------------------------------------------------------------------------

    def _current(self, job_id: str, epoch: int | None = None) -> Assignment:
        with self._lock:
            job = self._job
        if job is None or job.job_id != job_id:
            held = f"job {job.job_id!r}" if job else "no job"
            raise NotFoundError(f"job {job_id!r} is not assigned to this stage (it holds {held})")
        if epoch is not None and epoch != job.epoch:
            raise FailedPreconditionError(
                f"plan epoch {epoch} for job {job_id!r}; this stage is at epoch {job.epoch}"
            )
        return job

    def _dial(self, address: str) -> grpc.Channel:
        """The channel to ``address``, opened on first use and kept while it is a neighbour."""
        if address not in self._channels:
            self._channels[address] = open_channel(
                address, self._options.security, self._options.limits
            )
        return self._channels[address]

    def _close_channel(self, address: str, still_used: str) -> None:
        """Closes the channel to a downstream neighbour this stage no longer sends to: after
        each recovery the neighbour is another stage, and a channel kept per address ever
        dialled would pile up (its subchannels keep reconnecting to the dead one)."""
        if address and address != still_used:
            channel = self._channels.pop(address, None)
            if channel is not None:
                channel.close()

    # -- control -----------------------------------------------------------------------------

    @handle_errors
    def Describe(
        self, request: stage_pb2.DescribeRequest, context: object
    ) -> stage_pb2.DescribeResponse:
        args = parse_json_object(request.model_args_json, "model_args_json")
        export = models.model_export(request.model, args)
        features = models.model_features(request.model, args)
        description = models.describe(
            request.model,
            args,
            input_shape=list(request.input_shape),
            input_dtype=request.input_dtype or "float32",
        )
        return stage_pb2.DescribeResponse(
            layers=[
                stage_pb2.LayerDescription(
                    index=layer.index,
                    num_parameters=layer.num_parameters,
                    parameter_bytes=layer.parameter_bytes,
                    activation_bytes=layer.activation_bytes,
                    trainable_bytes=layer.trainable_bytes,
                    tensors=[
                        stage_pb2.TensorDescription(name=t.name, shape=t.shape, dtype=t.dtype)
                        for t in layer.tensors
                    ],
                )
                for layer in description.layers
            ],
            export_json=json.dumps(export) if export is not None else "",
            kv_cache=features.new_cache is not None,
            side_inputs=list(features.side_inputs),
            fuses_caches=features.new_cache is not None and features.fuses_caches,
            max_positions=features.max_positions or 0,
        )

    @handle_errors
    def Assign(self, request: stage_pb2.AssignRequest, context: object) -> stage_pb2.AssignResponse:
        checked = check_assign(request)
        with self._lock:
            previous = self._job
        if previous is not None and previous.job_id != request.job_id:
            # The coordinator is the authority: a stage it declared lost and now reuses may
            # still hold an old job, which is dropped here.
            logger.warning("dropping job %s to serve job %s", previous.job_id, request.job_id)
        if previous is not None and not self._fits_beside(previous, checked.config, checked.chunks):
            self._drop(previous, request.downstream_address)
        assignment = Assignment.build(
            checked, options=self._options, dial=self._dial, codec=self._codec
        )
        with self._lock:
            previous, self._job = self._job, assignment
        if previous is not None:
            previous.close()
            self._close_channel(previous.downstream_address, request.downstream_address)
        runtime = assignment.engine.runtime
        logger.info(
            "job %s: holding layers [%d, %d) as rank %d of %d (%d parameters)",
            request.job_id,
            request.stage.start_layer,
            request.stage.end_layer,
            request.stage.rank,
            request.num_stages,
            runtime.num_parameters,
        )
        return stage_pb2.AssignResponse(num_parameters=runtime.num_parameters)

    def _fits_beside(
        self, previous: Assignment, config: JobConfig, chunks: list[tuple[int, int]]
    ) -> bool:
        """Whether the weights of layers ``chunks`` fit in this stage's budget beside what
        ``previous`` holds (see [Note: one copy while reassigned] in stage/assignment.py)."""
        held = previous.held_bytes()
        if held == 0:
            return True
        layers = _layer_bytes(config.model, config.model_args_json())
        need = sum(sum(layers[a:b]) for a, b in chunks)
        if config.precision == "bf16":
            need //= 2
        budget = self._options.memory_bytes
        if held + need <= budget:
            return True
        logger.info(
            "job %s: releasing its %.1f MiB before building %.1f MiB of weights: both would "
            "not fit the budget of %.1f MiB",
            previous.job_id,
            held / 2**20,
            need / 2**20,
            budget / 2**20,
        )
        return False

    def _drop(self, previous: Assignment, downstream_address: str) -> None:
        """Releases ``previous`` before its replacement is built."""
        with self._lock:
            if self._job is previous:
                self._job = None
        previous.close()
        self._close_channel(previous.downstream_address, downstream_address)
        give_back()  # before the replacement's tensors are built (see malloc.give_back)

    @handle_errors
    def Release(
        self, request: stage_pb2.ReleaseRequest, context: object
    ) -> stage_pb2.ReleaseResponse:
        job = self._current(request.job_id)
        with self._lock:
            self._job = None
        job.close()
        self._close_channel(job.downstream_address, "")
        logger.info("job %s: released", request.job_id)
        return stage_pb2.ReleaseResponse()

    def close(self) -> None:
        """Ends the service once its server has stopped: closes the job it holds (its
        links, shared memory and caches), its channels, and the workers of its Control
        streams. Idempotent."""
        with self._lock:
            job, self._job = self._job, None
            channels, self._channels = list(self._channels.values()), {}
        if job is not None:
            job.close()
        for channel in channels:
            channel.close()
        self._control_pool.shutdown(wait=False, cancel_futures=True)

    # -- runs --------------------------------------------------------------------------------

    @handle_errors
    def RunStep(
        self,
        received: Incoming[stage_pb2.RunStepRequest] | stage_pb2.RunStepRequest | WireFormatError,
        context: object,
    ) -> stage_pb2.RunStepResponse:
        # Served with payload_wire's parser (see stage.server.add_stage_service).
        return self._run_step(RUN_STEP.received(received))

    def _run_step(self, incoming: Incoming[stage_pb2.RunStepRequest]) -> stage_pb2.RunStepResponse:
        """A run, as RunStep and a Control stream's run message carry it."""
        request, payloads = incoming.message, incoming.payloads
        job = self._current(request.job_id, request.plan_epoch)
        rt = job.runtime
        if request.mode not in (stage_pb2.TRAIN, stage_pb2.INFER, stage_pb2.GENERATE):
            raise InvalidArgumentError(f"mode {request.mode} must be TRAIN, INFER or GENERATE")
        training = request.mode == stage_pb2.TRAIN
        generating = request.mode == stage_pb2.GENERATE
        m = request.num_microbatches
        if not 1 <= m <= MAX_MICROBATCHES:
            raise InvalidArgumentError(f"num_microbatches ({m}) must be in [1, {MAX_MICROBATCHES}]")
        expected_inputs = m if rt.is_first else 0
        expected_targets = m if rt.is_last and training else 0
        if len(request.inputs) != expected_inputs:
            raise InvalidArgumentError(
                f"rank {rt.rank} expects {expected_inputs} inputs; got {len(request.inputs)}"
            )
        if len(request.targets) != expected_targets or len(request.loss_weights) != (
            expected_targets
        ):
            raise InvalidArgumentError(
                f"rank {rt.rank} expects {expected_targets} targets and loss weights; got "
                f"{len(request.targets)} and {len(request.loss_weights)}"
            )
        if len(request.side_inputs) not in (0, m):
            raise InvalidArgumentError(
                f"side inputs for {len(request.side_inputs)} micro-batches; expected 0 or {m}"
            )
        caches = cache_refs(request, m, generating)
        steps = decode_steps(request, caches, rt.is_first, rt.is_last)
        sampling = step_sampling(request, caches, steps) if rt.is_last else []
        # Inputs and side inputs go to the layers, which may write to them in place: on the
        # CPU they are copies of their own, elsewhere the move to the device copies them.
        # Targets only reach the loss, which reads them where they lie in the request.
        own = self._options.device.type == "cpu"
        inputs = [decode(t, self._codec, payloads, copy=own) for t in request.inputs]
        targets = [decode(t, self._codec, payloads, copy=False) for t in request.targets]
        side = [
            {name: decode(t, self._codec, payloads, copy=own) for name, t in entry.tensors.items()}
            for entry in request.side_inputs
        ]
        # The stages compute one after another (see [Note: generation threads]).
        with _threads(self._options.generate_threads if generating and in_turn(caches, m) else 0):
            result = job.engine.run_step(
                request.run_id,
                training=training,
                num_microbatches=m,
                data=RunInputs(
                    inputs=inputs,
                    targets=targets,
                    loss_weights=list(request.loss_weights),
                    side=side,
                    caches=caches,
                    greedy=generating and request.greedy,
                    decode_steps=steps,
                    sampling=sampling,
                    microbatch_offset=request.microbatch_offset,
                    replicas=GroupSpec.from_proto(request.replicas)
                    if request.HasField("replicas")
                    else None,
                ),
                commit=carried_commit(request),
                generating=generating,
            )
        response = stage_pb2.RunStepResponse(
            losses=result.losses,
            outputs=[encode(output) for output in result.outputs],
            peak_in_flight=result.peak_in_flight,
            generator_states=result.generator_states,
        )
        if result.grad_norm_sq is not None:
            response.grad_norm_sq = result.grad_norm_sq
        return response

    @handle_errors
    def ReleaseSession(
        self, request: stage_pb2.ReleaseSessionRequest, context: object
    ) -> stage_pb2.ReleaseSessionResponse:
        job = self._current(request.job_id)
        if request.all_sessions == bool(request.session):
            raise InvalidArgumentError(
                f"release session {request.session!r} with all_sessions={request.all_sessions}: "
                "expected a session or all_sessions, not both or neither"
            )
        freed = job.engine.release_sessions(None if request.all_sessions else request.session)
        return stage_pb2.ReleaseSessionResponse(freed_bytes=freed)

    @handle_errors
    def ProbeLink(
        self, request: stage_pb2.ProbeLinkRequest, context: object
    ) -> stage_pb2.ProbeLinkResponse:
        split_address(request.target)  # a typed error before any dialling
        # A channel of its own (the neighbour's is kept for Exchange; a probe may go to any
        # stage the coordinator names), closed when the probe ends.
        with open_channel(request.target, self._options.security, self._options.limits) as ch:
            measured = probe.probe(ch, request.target)
        return stage_pb2.ProbeLinkResponse(
            bytes_per_s=measured.bytes_per_s,
            bytes=measured.bytes,
            seconds=measured.seconds,
            rounds=measured.rounds,
        )

    @handle_errors
    def Sink(
        self, request_iterator: Iterable[stage_pb2.SinkFrame], context: object
    ) -> stage_pb2.SinkResponse:
        return stage_pb2.SinkResponse(received_bytes=probe.receive(request_iterator))

    @handle_errors
    def Commit(self, request: stage_pb2.CommitRequest, context: object) -> stage_pb2.CommitResponse:
        return self._commit(request)

    def _commit(self, request: stage_pb2.CommitRequest) -> stage_pb2.CommitResponse:
        """A commit, as Commit and a Control stream's commit message carry it."""
        job = self._current(request.job_id, request.plan_epoch)
        scale = request.grad_scale if request.HasField("grad_scale") else None
        return stage_pb2.CommitResponse(step=job.engine.commit(request.run_id, scale))

    @handle_errors
    def Abort(self, request: stage_pb2.AbortRequest, context: object) -> stage_pb2.AbortResponse:
        return self._abort(request)

    def _abort(self, request: stage_pb2.AbortRequest) -> stage_pb2.AbortResponse:
        """An abort, as Abort and a Control stream's abort message carry it."""
        job = self._current(request.job_id, request.plan_epoch)
        job.engine.abort(request.run_id)
        return stage_pb2.AbortResponse()

    # Served with control_wire's codec (see stage.server.add_stage_service): it is given parsed
    # messages and yields Reply, not ControlReply.
    @handle_errors
    def Control(  # type: ignore[override]
        self,
        request_iterator: Iterable[Incoming[stage_pb2.ControlRequest] | Unreadable],
        context: grpc.ServicerContext,
    ) -> Iterator[Reply]:
        """Runs, commits and aborts of the coordinator over one long-lived stream (see [Note:
        control stream] in pipesvc/coordinator/control_stream.py), each handled by the code
        of its unary call, concurrently."""
        with self._lock:
            self._control_opened += 1
            self._control_open += 1
        try:
            yield from ControlServer(self._control_one, self._control_pool).serve(
                request_iterator, context
            )
        finally:
            with self._lock:
                self._control_open -= 1

    def _control_one(self, received: Incoming[stage_pb2.ControlRequest]) -> Reply:
        """One control message's reply: what its unary call would return or end with."""
        message = received.message
        kind = message.WhichOneof("kind")
        try:
            if kind == "run":
                run = message.run
                payloads = received.payloads
                if run.payloads:  # a peer that put them in the run itself (plain protobuf)
                    if payloads:
                        raise InvalidArgumentError(
                            f"control message {message.id} carries payloads both in its run "
                            "and beside it; expected one place"
                        )
                    payloads = tuple(memoryview(p) for p in run.payloads)
                return ok(message.id, "run", self._run_step(Incoming(run, payloads)))
            if kind == "commit":
                return ok(message.id, "commit", self._commit(message.commit))
            if kind == "abort":
                return ok(message.id, "abort", self._abort(message.abort))
            raise InvalidArgumentError(
                f"control message {message.id} carries no run, commit or abort (an unknown "
                "kind from a newer coordinator?)"
            )
        except Exception as exc:
            return failed(message.id, to_pipesvc(exc, f"Control ({kind or 'unknown'})"))

    # -- data plane --------------------------------------------------------------------------

    # Served with frame_wire's codec (see stage.server.add_stage_service), so it yields OutFrame.
    @handle_errors
    def SwapTiedGradients(
        self, request_iterator: Iterable[stage_pb2.TiedGradientFrame], context: object
    ) -> Iterator[common_pb2.TensorFrame]:
        requests = iter(request_iterator)
        first = next(requests, None)
        if first is None:
            raise InvalidArgumentError("a tied-gradient swap sent no frames")
        job = self._current(first.job_id, first.plan_epoch)
        if job.tied is None:
            raise FailedPreconditionError(
                f"job {first.job_id!r} shares no tied parameters of this stage with another"
            )
        ident = (first.job_id, first.plan_epoch, first.run_id, first.rank)

        def frames() -> Iterator[common_pb2.TensorFrame]:
            for request in itertools.chain([first], requests):
                if (request.job_id, request.plan_epoch, request.run_id, request.rank) != ident:
                    raise InvalidArgumentError(
                        f"a tied-gradient swap of run {first.run_id} from rank {first.rank} "
                        f"switched to run {request.run_id} from rank {request.rank}"
                    )
                yield request.frame

        own = job.tied.answer(first.run_id, first.rank, frames())
        for group, tensor in own.items():
            yield from named_frames(str(group), tensor.detach().cpu())

    def Exchange(  # type: ignore[override]
        self, request_iterator: Iterable[stage_pb2.DataFrame], context: grpc.ServicerContext
    ) -> Iterator[OutFrame | stage_pb2.DataFrame]:
        with self._lock:
            job = self._job
        if job is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this stage holds no job")
            return

        def establish(link: UpstreamLink) -> None:
            # Only a stream whose first frame passed the identity checks replaces the link
            # gradients go back on: a junk stream never cuts the real upstream off.
            previous, job.upstream = job.upstream, link
            if previous is not None and previous is not link:
                previous.close()

        link = UpstreamLink(
            job_id=job.job_id,
            epoch=job.epoch,
            mailbox=job.mailbox,
            limits=self._codec,
            duplicate_sends=self._options.duplicate_sends,
            shm_bytes=self._options.shm_bytes,
            metrics=self._options.metrics,
            on_established=establish,
        )
        try:
            yield from link.serve(request_iterator)
        except StepAbortedError:
            return
        except PipesvcError as exc:
            abort_with(context, exc)
