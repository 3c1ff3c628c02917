"""The job a stage holds: its step engine and its links to the neighbouring stages.

[Note: one copy while reassigned] Every recovery and re-plan assigns each stage afresh under a
new epoch. The new runtime takes its state from a checkpoint on the coordinator's disk (a
re-plan writes one first, see [Note: replan]), never from the stage's old runtime, so the old
state is dead once a new Assign arrives. Building the new runtime before dropping the old
briefly holds both: the old weights, gradients, optimizer state, snapshot and caches plus the
new weights, which a stage planned to fill its budget (``partition="memory"``) does not have.
So ``Assign`` keeps the old job while it builds only when both fit the stage's memory budget
(``held_bytes`` beside the new layers' weights); otherwise it releases the old job first, and
an Assign that then fails leaves the stage holding no job (the coordinator's next call rebuilds
it, as after any failed assignment). Either way ``close`` drops the tensors at once rather
than when Python's cycle collector finds the assignment (its engine's send functions refer back
to it). Restoring then holds one copy too: the runtime takes the staged optimizer state without
copying it (``StageRuntime.check_state(owned=True)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import grpc
import torch

from pipesvc import models
from pipesvc.core.config import JobConfig, config_from_proto
from pipesvc.core.link_codecs import stage_codecs
from pipesvc.core.plan import PipelineStage
from pipesvc.core.tensor_codec import CodecLimits
from pipesvc.core.tying import StageTies, stage_ties
from pipesvc.errors import FailedPreconditionError, InvalidArgumentError
from pipesvc.stage.collective.replica_group import ReplicaGroup
from pipesvc.stage.compute.engine import StepEngine
from pipesvc.stage.compute.recorder import RunRecorder
from pipesvc.stage.compute.runtime import StageRuntime
from pipesvc.stage.compute.sessions import ExpiryTimer, SessionCaches, expiry_interval
from pipesvc.stage.compute.stage_state import storage_bytes
from pipesvc.stage.dataplane.mailbox import MAX_ITEMS, PARTS, Mailbox, MailKey
from pipesvc.stage.net.links import DownstreamLink, UpstreamLink
from pipesvc.stage.net.tied_link import TiedLink
from pipesvc.stage.options import StageOptions
from pipesvc.v1 import stage_pb2
from pipesvc.wire.transport import split_address

logger = logging.getLogger(__name__)


class Assignment:
    """One job held by this stage: its step engine and its links to the neighbours."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        runtime: StageRuntime,
        downstream_address: str,
        options: StageOptions,
        dial: Callable[[str], grpc.Channel],
        tied: TiedLink | None = None,
        replicas: ReplicaGroup | None = None,
    ) -> None:
        self.job_id = job_id
        self.epoch = epoch
        self.downstream_address = downstream_address
        self.downstream: DownstreamLink | None = None
        self.upstream: UpstreamLink | None = None
        self.staged: dict[str, torch.Tensor] = {}
        self._options = options
        self._dial = dial
        self.tied = tied
        """The swap of tied gradients with another stage, if this stage shares any."""
        self.engine = StepEngine(
            runtime=runtime,
            # Two tensors per micro-batch where the model carries a vector (see [Note: mailbox
            # bound] in pipesvc.stage.dataplane.mailbox).
            mailbox=Mailbox(MAX_ITEMS * (PARTS if runtime.features.carry else 1)),
            send_activation=self._send_activation,
            send_gradient=self._send_gradient,
            recorder=RunRecorder(options.metrics),
            recv_timeout_s=options.recv_timeout_s,
            job_id=job_id,
            downstream_address=downstream_address,
            metrics=options.metrics,
            fault_kill=options.fault_kill,
            tied=tied,
            replicas=replicas,
            sessions=SessionCaches(
                runtime.features.new_cache,
                budget_bytes=options.kv_budget_bytes,
                idle_s=options.session_idle_s,
                layout=runtime.features.cache_layout,
            ),
        )
        self._expiry = ExpiryTimer(
            self.engine.expire_sessions, expiry_interval(options.session_idle_s)
        )

    @classmethod
    def build(
        cls,
        checked: CheckedAssign,
        *,
        options: StageOptions,
        dial: Callable[[str], grpc.Channel],
        codec: CodecLimits,
    ) -> Assignment:
        """The job an Assign describes (see ``check_assign``): its runtime with the layers
        built, the tied-weight link and the replicas' gradient group where it has them, its
        engine and its links.

        Raises:
            InvalidArgumentError: the model refuses its arguments.
            ResourceExhaustedError: the layers do not fit.
        """
        request, config, chunks, ties = checked
        stage = request.stage
        runtime = StageRuntime(
            config=config,
            start_layer=stage.start_layer,
            end_layer=stage.end_layer,
            rank=stage.rank,
            num_stages=request.num_stages,
            device=options.device,
            ties=ties,
            chunks=chunks,
            links=stage_codecs(
                config, [PipelineStage.from_proto(p) for p in request.plan], stage.rank
            ),
        )
        tied = None
        if runtime.ties.peers:
            params = dict(runtime.module.named_parameters())
            tied = TiedLink(
                job_id=request.job_id,
                epoch=request.plan_epoch,
                rank=stage.rank,
                ties=runtime.ties,
                shapes={
                    g: (tuple(params[keys[0]].shape), params[keys[0]].dtype)
                    for g, keys in runtime.ties.local.items()
                },
                addresses={p.rank: p.address for p in request.plan},
                dial=dial,
                limits=codec,
                timeout_s=options.recv_timeout_s,
            )
        replicas = None
        if request.num_replicas > 1:
            replicas = ReplicaGroup(
                job_id=request.job_id,
                epoch=request.plan_epoch,
                rank=stage.rank,
                replica=stage.replica,
                num_replicas=request.num_replicas,
                own_host=split_address(options.address)[0],
                coordinator_host=options.coordinator_host,
                timeout_s=options.recv_timeout_s,
            )
        return cls(
            job_id=request.job_id,
            epoch=request.plan_epoch,
            runtime=runtime,
            downstream_address=request.downstream_address,
            options=options,
            dial=dial,
            tied=tied,
            replicas=replicas,
        )

    @property
    def runtime(self) -> StageRuntime:
        return self.engine.runtime

    @property
    def mailbox(self) -> Mailbox:
        return self.engine.mailbox

    def _send_activation(self, key: MailKey, tensor: torch.Tensor) -> None:
        if self.downstream is None:
            options = self._options
            self.downstream = DownstreamLink(
                channel=self._dial(self.downstream_address),
                address=self.downstream_address,
                job_id=self.job_id,
                epoch=self.epoch,
                mailbox=self.mailbox,
                limits=options.limits.codec(),
                duplicate_sends=options.duplicate_sends,
                shm_bytes=options.shm_bytes,
                metrics=options.metrics,
            )
        self.downstream.send(key, tensor)

    def _send_gradient(self, key: MailKey, tensor: torch.Tensor) -> None:
        if self.upstream is None:
            raise FailedPreconditionError("no upstream stream to send gradients on")
        self.upstream.send(key, tensor)

    def held_bytes(self) -> int:
        """Bytes of memory the job holds here: its runtime's tensors, the snapshot, the state
        staged for loading (each storage once) and the generation caches."""
        engine = self.engine
        tensors = self.runtime.held_tensors() + list(self.staged.values())
        snapshot = engine.snapshot
        if snapshot is not None:
            tensors += list(snapshot.tensors.values())
        caches = engine.sessions.total_bytes() if engine.sessions is not None else 0
        return storage_bytes(tensors) + caches

    def close(self) -> None:
        """Closes the links and drops every tensor the job holds (see [Note: one copy while
        reassigned]); a stream still sending the snapshot keeps its own reference."""
        self._expiry.stop()
        if self.engine.replicas is not None:
            self.engine.replicas.close()
        if self.downstream is not None:
            self.downstream.close()
        if self.upstream is not None:
            self.upstream.close()
        engine = self.engine
        self.staged = {}
        snapshot = engine.snapshot
        if snapshot is not None:
            engine.drop_snapshot(snapshot.step)
        if engine.sessions is not None:
            engine.sessions.clear()
        # A run still computing (none should be: the coordinator aborts runs before it
        # reassigns) keeps the runtime until it ends; waiting for it here could stall Assign.
        if engine.run_lock.acquire(blocking=False):
            try:
                self.runtime.release()
            finally:
                engine.run_lock.release()
        else:
            logger.warning(
                "job %s: a run is still computing; its memory is freed when it ends", self.job_id
            )


class CheckedAssign(NamedTuple):
    """An Assign's request, checked: its job's configuration, this stage's layer ranges and
    the ties of its parameters (None: the model ties none)."""

    request: stage_pb2.AssignRequest
    config: JobConfig
    chunks: list[tuple[int, int]]
    ties: StageTies | None


def check_assign(request: stage_pb2.AssignRequest) -> CheckedAssign:
    """An Assign's job configuration, this stage's layer ranges and its ties, checked before
    anything of the stage changes.

    Raises:
        InvalidArgumentError: no job id, a rank or replica out of range, a downstream address
            where none belongs (or none where one does), or a plan that disagrees with the
            stage's own entry.
    """
    if not request.job_id:
        raise InvalidArgumentError("job_id must not be empty")
    config = config_from_proto(request.spec)
    stage = request.stage
    if not stage.rank < request.num_stages:
        raise InvalidArgumentError(
            f"rank ({stage.rank}) must be below num_stages ({request.num_stages})"
        )
    chunks = _chunk_ranges(request)
    is_last = stage.rank == request.num_stages - 1 and len(chunks) == 1
    if is_last == bool(request.downstream_address):
        raise InvalidArgumentError(
            f"rank {stage.rank} of {request.num_stages} got downstream address "
            f"{request.downstream_address!r}; only the last stage has none (and none "
            "when the stages hold several layer ranges each)"
        )
    if request.num_replicas > 1 and not stage.replica < request.num_replicas:
        raise InvalidArgumentError(
            f"replica ({stage.replica}) must be below num_replicas ({request.num_replicas})"
        )
    groups = models.tied_parameters(config.model, config.model_args)
    ties = stage_ties(groups, _plan_ranges(request), stage.rank) if groups else None
    return CheckedAssign(request, config, chunks, ties)


def _chunk_ranges(request: stage_pb2.AssignRequest) -> list[tuple[int, int]]:
    """This stage's layer ranges, chunk 0 first (see [Note: virtual stages]): its own entry,
    then those of its rank in the plan an Assign carries.

    Raises:
        InvalidArgumentError: the plan's entries of this rank are not chunks 0, 1, ... in
            layer order, or chunk 0 is not the stage's own range.
    """
    stage = request.stage
    mine = sorted((p for p in request.plan if p.rank == stage.rank), key=lambda p: p.chunk)
    if not mine:
        return [(stage.start_layer, stage.end_layer)]
    ranges = [(p.start_layer, p.end_layer) for p in mine]
    if [p.chunk for p in mine] != list(range(len(mine))) or ranges[0] != (
        stage.start_layer,
        stage.end_layer,
    ):
        raise InvalidArgumentError(
            f"the plan gives rank {stage.rank} chunks {[p.chunk for p in mine]} with layers "
            f"{ranges}; expected chunks 0, 1, ... starting with [{stage.start_layer}, "
            f"{stage.end_layer})"
        )
    if len(ranges) != request.spec.virtual_stages and request.spec.virtual_stages > 1:
        raise InvalidArgumentError(
            f"the plan gives rank {stage.rank} {len(ranges)} layer ranges; the job has "
            f"virtual_stages {request.spec.virtual_stages}"
        )
    return ranges


def _plan_ranges(request: stage_pb2.AssignRequest) -> list[tuple[int, int]]:
    """Each rank's layer range from the plan an Assign carries (for tied parameters).

    Raises:
        InvalidArgumentError: the plan does not list each rank once, or disagrees with the
            stage's own entry.
    """
    by_rank = {p.rank: (p.start_layer, p.end_layer) for p in request.plan}
    own = request.stage
    if sorted(by_rank) != list(range(request.num_stages)) or len(request.plan) != len(by_rank):
        raise InvalidArgumentError(
            f"the plan lists ranks {sorted(p.rank for p in request.plan)}; a model with tied "
            f"parameters needs each of the {request.num_stages} ranks once"
        )
    if by_rank[own.rank] != (own.start_layer, own.end_layer):
        raise InvalidArgumentError(
            f"the plan gives rank {own.rank} layers {list(by_rank[own.rank])}; the stage entry "
            f"says [{own.start_layer}, {own.end_layer}]"
        )
    return [by_rank[r] for r in range(request.num_stages)]
