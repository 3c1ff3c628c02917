"""The job a stage holds: its step engine and its links to the neighbouring stages."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import torch

from pipesvc.errors import FailedPreconditionError
from pipesvc.stage.engine import StepEngine
from pipesvc.stage.links import DownstreamLink, UpstreamLink
from pipesvc.stage.mailbox import Mailbox, MailKey
from pipesvc.stage.options import StageOptions
from pipesvc.stage.recorder import RunRecorder
from pipesvc.stage.replica_group import ReplicaGroup
from pipesvc.stage.runtime import StageRuntime
from pipesvc.stage.sessions import ExpiryTimer, SessionCaches, expiry_interval
from pipesvc.stage.tied_link import TiedLink


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
            mailbox=Mailbox(),
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

    def close(self) -> None:
        self._expiry.stop()
        if self.engine.replicas is not None:
            self.engine.replicas.close()
        if self.downstream is not None:
            self.downstream.close()
        if self.upstream is not None:
            self.upstream.close()
