"""The coordinator's registry of stage servers: who they are, and which job each serves.

[Note: forgetting stages] A stage is known by its address, and one restarted on a free port
comes back under a new one, so a registry that kept every address ever registered would grow
with every restart, and ListStages and the live page would health-check every dead address on
every call. A record remembers when its stage last registered (stages re-register on their
heartbeat, every 2 s by default); the coordinator's maintenance forgets a record unseen for
``forget_after_s`` (``--forget-stages-after-s``) unless it serves a job or an open job's plan
names it (recovery and reconciling read those records). A forgotten stage that comes back
registers as a new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import Message

from pipesvc.coordinator.control_stream import ControlStreams
from pipesvc.coordinator.link_rates import LinkRates
from pipesvc.core.health import Health
from pipesvc.core.limits import Limits
from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from pipesvc.wire.control_wire import Kind
from pipesvc.wire.payload_wire import RUN_STEP, Outgoing
from pipesvc.wire.security import Security
from pipesvc.wire.transport import (
    health_check,
    health_status,
    open_channel,
    split_address,
    unary_method,
)

REFUSALS_KEPT_S = 60.0
"""How long a stage refused at registration is remembered (a running one retries with every
heartbeat), for the errors of jobs that then find no stage (see [Note: wire protocol])."""
MAX_REFUSALS = 64

RUN_STEP_METHOD = stage_pb2.DESCRIPTOR.services_by_name["StageService"].methods_by_name["RunStep"]
RunStepMethod: TypeAlias = (
    "grpc.UnaryUnaryMultiCallable["
    "Outgoing[stage_pb2.RunStepRequest] | stage_pb2.RunStepRequest, stage_pb2.RunStepResponse]"
)
"""A stage's RunStep as the coordinator calls it (a string: grpc's classes are generic only in
its stubs)."""


@dataclass(kw_only=True)
class StageRecord:
    """A registered stage server."""

    address: str
    device: str
    memory_bytes: int
    models: tuple[str, ...]
    job_id: str = ""
    rank: int = 0
    start_layer: int = 0
    end_layer: int = 0
    order: int = 0
    """Registration order, for a stable choice of stages."""
    alive: bool = True
    """False once declared lost, until the stage registers again."""
    seen_at: float = field(default_factory=time.monotonic)
    """When the stage last registered (``time.monotonic``)."""


@dataclass
class StageRegistry:
    """Thread-safe map from stage address to record, plus one channel per stage."""

    security: Security = field(default_factory=Security)
    limits: Limits = field(default_factory=Limits)
    _records: dict[str, StageRecord] = field(default_factory=dict)
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _counter: int = 0
    _refused: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    """Address -> why it was refused, when last and when that was last news (monotonic),
    the newest last."""
    _changed: threading.Condition = field(init=False)
    """Notified when a stage registers or a job frees its stages (on ``_lock``)."""

    control: ControlStreams = field(init=False)
    """The jobs' Control streams to these stages (see [Note: control stream])."""
    link_rates: LinkRates = field(default_factory=LinkRates)
    """The probed rates between these stages' hosts (see [Note: link rate cache])."""

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)
        self.control = ControlStreams(
            channel=self._channel,
            unary=self._unary,
            max_message_bytes=self.limits.max_message_bytes,
        )

    def register(self, record: StageRecord) -> bool:
        """Adds or refreshes a stage (its address is its identity); True if it is new or was
        lost before.

        Raises:
            InvalidArgumentError: the address is not HOST:PORT with a non-zero port.
        """
        _, port = split_address(record.address)
        if port == 0:
            raise InvalidArgumentError(f"stage address {record.address!r} has port 0")
        with self._lock:
            self._refused.pop(record.address, None)
            old = self._records.get(record.address)
            self._counter += 1
            record.order = old.order if old else self._counter
            if old is not None and old.alive:
                record.job_id, record.rank = old.job_id, old.rank
                record.start_layer, record.end_layer = old.start_layer, old.end_layer
            self._records[record.address] = record
            self._changed.notify_all()
            new = old is None or not old.alive
        if new:  # perhaps restarted as a newer stage: it may serve Control now
            self.control.forget(record.address)
        return new

    def refuse(self, address: str, reason: str) -> bool:
        """Remembers that the stage at ``address`` was refused at registration, and why;
        returns whether that is news (not the same refusal within ``REFUSALS_KEPT_S``: a
        running stage is refused again with every heartbeat)."""
        now = time.monotonic()
        with self._lock:
            old = self._refused.pop(address, None)
            news = old is None or old[0] != reason or now - old[2] > REFUSALS_KEPT_S
            self._refused[address] = (reason, now, now if news or old is None else old[2])
            while len(self._refused) > MAX_REFUSALS:
                del self._refused[next(iter(self._refused))]
            return news

    def refusals(self) -> list[str]:
        """Why stages were refused at registration within ``REFUSALS_KEPT_S``, newest first."""
        since = time.monotonic() - REFUSALS_KEPT_S
        with self._lock:
            return [why for why, seen, _ in reversed(self._refused.values()) if seen >= since]

    def all(self) -> list[StageRecord]:
        """Every record, in registration order."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.order)

    def free(self, model: str) -> list[StageRecord]:
        """Stages with no job that can build ``model``, in registration order."""
        return [r for r in self.all() if r.alive and not r.job_id and model in r.models]

    def wait_free(self, model: str, count: int, timeout_s: float) -> int:
        """Waits until ``count`` stages are free to build ``model``, or ``timeout_s`` passes;
        returns how many are free then. A stage registering or a job's stages being released
        wakes it; nothing is claimed, so another job may still take them first."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                free = sum(
                    1
                    for r in self._records.values()
                    if r.alive and not r.job_id and model in r.models
                )
                left_s = deadline - time.monotonic()
                if free >= count or left_s <= 0:
                    return free
                self._changed.wait(left_s)

    def claim(self, addresses: list[str], job_id: str) -> bool:
        """Marks the stages as serving ``job_id``; False (and no change) if one is taken or
        lost."""
        with self._lock:
            records = [self._records.get(a) for a in addresses]
            if any(r is None or r.job_id or not r.alive for r in records):
                return False
            for address in addresses:
                self._records[address].job_id = job_id
            return True

    def unclaim(self, addresses: list[str]) -> None:
        """Returns stages that left their job's plan to the free pool."""
        with self._lock:
            for address in addresses:
                if address in self._records:
                    self._records[address].job_id = ""
            self._changed.notify_all()

    def place(self, address: str, *, rank: int, start_layer: int, end_layer: int) -> None:
        """Records a stage's place in its job's plan."""
        with self._lock:
            record = self._records[address]
            record.rank, record.start_layer, record.end_layer = rank, start_layer, end_layer

    def mark_lost(self, address: str) -> None:
        """Takes a lost stage out of its job and out of the free pool until it re-registers."""
        with self._lock:
            record = self._records.get(address)
            if record is not None:
                record.job_id = ""
                record.alive = False
        self.control.close(address=address)

    def release(self, job_id: str) -> None:
        """Frees every stage serving ``job_id``, and closes the job's Control streams."""
        with self._lock:
            for record in self._records.values():
                if record.job_id == job_id:
                    record.job_id = ""
            self._changed.notify_all()
        self.control.close(job_id=job_id)

    def forget_unseen(self, older_than_s: float, keep: Collection[str] = ()) -> list[str]:
        """Forgets the stages that have not registered for ``older_than_s``, except those
        serving a job and the ``keep`` addresses (see [Note: forgetting stages]); returns the
        addresses forgotten."""
        now = time.monotonic()
        with self._lock:
            gone = [
                a
                for a, r in self._records.items()
                if now - r.seen_at > older_than_s and not r.job_id and a not in keep
            ]
            for address in gone:
                del self._records[address]
                # Not closed here: a health check may be using it; it closes once unreferenced.
                self._channels.pop(address, None)
        for address in gone:
            self.control.close(address=address)
            self.control.forget(address)
        return gone

    def _channel(self, address: str) -> grpc.Channel:
        """The (cached) channel to ``address``."""
        with self._lock:
            if address not in self._channels:
                self._channels[address] = open_channel(address, self.security, self.limits)
            return self._channels[address]

    def stub(self, address: str) -> stage_pb2_grpc.StageServiceStub:
        """A stub on the (cached) channel to ``address``."""
        return stage_pb2_grpc.StageServiceStub(self._channel(address))

    def run_step(self, address: str) -> RunStepMethod:
        """RunStep on the (cached) channel to ``address``, its tensors' bytes appended beside
        the message (see [Note: payload wire])."""
        channel = self._channel(address)
        return unary_method(channel, RUN_STEP_METHOD, RUN_STEP.serialize, stage_pb2.RunStepResponse)

    def _unary(
        self,
        address: str,
        kind: Kind,
        message: Message,
        payloads: Sequence[memoryview],
        timeout_s: float,
    ) -> grpc.Future[Any]:
        """A control message as its unary call, for a stage without Control."""
        if kind == "run":
            assert isinstance(message, stage_pb2.RunStepRequest)
            run: Any = self.run_step(address).future
            return run(Outgoing(message, payloads), timeout=timeout_s)  # type: ignore[no-any-return]
        stub = self.stub(address)
        if kind == "commit":
            assert isinstance(message, stage_pb2.CommitRequest)
            return stub.Commit.future(message, timeout=timeout_s)
        assert isinstance(message, stage_pb2.AbortRequest)
        return stub.Abort.future(message, timeout=timeout_s)

    def health(self, address: str, timeout_s: float) -> Health:
        """The health of the stage at ``address``, checked on the cached channel."""
        return health_status(self._channel(address), timeout_s)

    def health_check(self, address: str, timeout_s: float) -> tuple[Health, bool]:
        """``health``, and whether a failed check found the stage gone (see
        ``transport.health_check``)."""
        return health_check(self._channel(address), timeout_s)

    def close(self) -> None:
        """Closes every Control stream and every channel."""
        self.control.close()
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
