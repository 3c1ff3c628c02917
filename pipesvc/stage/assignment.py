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

import grpc
import torch

from pipesvc.errors import FailedPreconditionError
from pipesvc.stage.collective.replica_group import ReplicaGroup
from pipesvc.stage.compute.engine import StepEngine
from pipesvc.stage.compute.recorder import RunRecorder
from pipesvc.stage.compute.runtime import StageRuntime, storage_bytes
from pipesvc.stage.compute.sessions import ExpiryTimer, SessionCaches, expiry_interval
from pipesvc.stage.dataplane.mailbox import MAX_ITEMS, PARTS, Mailbox, MailKey
from pipesvc.stage.net.links import DownstreamLink, UpstreamLink
from pipesvc.stage.net.tied_link import TiedLink
from pipesvc.stage.options import StageOptions

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
