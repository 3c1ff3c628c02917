"""Summing a stage's gradients with the stages of the same rank in the other replicas of its
pipeline (see [Note: replicas] in ``pipesvc.coordinator.replicas``).

The sum is torch.distributed's gloo all-reduce over a process group of its own per job, plan
epoch, generation and rank: it is built directly on a ``PrefixStore`` over the coordinator's
``TCPStore``, never as torch's default group, so one stage process can serve job after job
and re-form its group after a recovery.

[Note: gradient group] A stage forms its group on the first training run that names it
(``RunStepRequest.replicas``) and keeps it while runs name the same store and generation. A
store is named by its address and by the nonce the coordinator drew when it opened it: a
restarted coordinator serves a new store, on the same port when that is fixed, and counts
generations from 0 again, so the nonce alone tells a group on the old store from a new one.
A store that fails while the members meet drops the group (StageUnavailableError), so the next
run forms a new one.
Forming waits for every member, so it runs on a helper thread while the run thread waits for
it or for the run's abort. Before each sum the members *meet* at the store (each adds
itself to the run's key; the last sets "all"; each polls for it, waking on an abort), and
only then post the all-reduce, from the run thread, on flat copies of the gradients (one
buffer per bucket), polling it too. So a run that fails or is aborted on one replica never
leaves a collective posted on another, and an abort returns at once: a gloo collective that
is never matched holds its thread, with the GIL, until the group's timeout when it is dropped
or waited on. Only a member that hangs inside a sum leaves one pending; it is parked (kept
alive) and the group dropped. The reduced sums are copied back into the gradients only by a
run that completed. The coordinator names a new generation after every aborted training run,
so a later run's group is always a fresh one. A dropped group is torn down on a daemon
thread.

Parameters that got no gradient are sent as zeros with a flag; after the sum a parameter that
no replica used keeps no gradient, as in one process.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import distributed

from pipesvc.core.group_keys import group_prefix
from pipesvc.errors import FailedPreconditionError, StageUnavailableError, StepAbortedError
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)

BUCKET_BYTES = 64 << 20
"""Most bytes of gradients in one all-reduce buffer (a bucket is one flat copy)."""
_c10d: Any = distributed  # its store and gloo classes are not in torch's public stubs
POLL_S = 0.0005
MEET_POLL_MAX_S = 0.01
"""The longest pause between two looks at the store while waiting for the other replicas."""
"""How often the run thread looks whether the all-reduce is done (or the run aborted)."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where a run's gradient group meets (the wire's ``ReplicaGroup``)."""

    store_host: str
    store_port: int
    generation: int
    store_id: str = ""
    """Which start of the coordinator's store: a restarted coordinator's store may have the
    same address (a fixed ``--store-port``) and counts generations from 0 again, so a group
    formed on the old one is recognised as stale by this alone."""

    @staticmethod
    def from_proto(message: stage_pb2.ReplicaGroup) -> GroupSpec:
        """The spec a run request names."""
        return GroupSpec(
            store_host=message.store_host,
            store_port=message.store_port,
            generation=message.generation,
            store_id=message.store_id,
        )


class ReplicaGroup:
    """This stage's side of its gradient group for one job at one plan epoch."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        rank: int,
        replica: int,
        num_replicas: int,
        own_host: str,
        coordinator_host: str,
        timeout_s: float,
    ) -> None:
        self._job_id, self._epoch, self._rank = job_id, epoch, rank
        self.replica, self.num_replicas = replica, num_replicas
        self._own_host = own_host.strip("[]")
        self._coordinator_host = coordinator_host.strip("[]")
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._spec: GroupSpec | None = None
        self._group: Any = None  # _c10d.ProcessGroupGloo once formed
        self._store: Any = None
        self._meeting: Any = None  # where the group's members meet before each sum
        self._met: str | None = None  # the key of the group's last meeting
        self._aborted: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.formed = 0
        """How many groups this stage formed (for tests and logs)."""

    def abort(self, run_id: int) -> None:
        """Wakes a reduce of run ``run_id`` (or one that starts later), which then raises."""
        with self._lock:
            self._aborted.setdefault(run_id, threading.Event()).set()

    def _abort_event(self, run_id: int) -> threading.Event:
        with self._lock:
            for old in [r for r in self._aborted if r < run_id]:
                del self._aborted[old]
            return self._aborted.setdefault(run_id, threading.Event())

    def reduce(self, run_id: int, spec: GroupSpec, params: Sequence[torch.nn.Parameter]) -> None:
        """Replaces each parameter's gradient by its sum over the replicas (see [Note:
        gradient group]).

        Raises:
            StepAbortedError: the run was aborted meanwhile (no gradient changed).
            StageUnavailableError: a member did not join or the all-reduce failed.
        """
        aborted = self._abort_event(run_id)
        group = self._group_for(spec, aborted)
        try:
            self._meet(run_id, aborted)
        except RuntimeError as exc:  # torch's DistNetworkError, DistStoreError: the store
            self._drop()  # a later run forms its group afresh
            raise StageUnavailableError(
                f"the gradient group of rank {self._rank} could not meet at its store "
                f"{spec.store_host or self._coordinator_host}:{spec.store_port} before the sum "
                f"of run {run_id}: {str(exc).splitlines()[0]}"
            ) from exc
        flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params])
        buckets = _buckets(params)
        flats = [_flatten(bucket) for bucket in buckets]
        works: list[Any] = []
        try:
            works = [group.allreduce([tensor]) for tensor in (flags, *flats)]
            self._wait(run_id, works, aborted)
        except (RuntimeError, StepAbortedError, StageUnavailableError) as exc:
            # A collective still pending is kept alive (see _park), never dropped here.
            _park(works, self._timeout.total_seconds())
            works = []
            self._drop()
            if isinstance(exc, RuntimeError):
                raise StageUnavailableError(
                    f"the gradient sum of run {run_id} with the other replicas failed: "
                    f"{str(exc).splitlines()[0]}"
                ) from exc
            raise
        for bucket, flat in zip(buckets, flats, strict=True):
            _unflatten_into(bucket, flat)
        for p, used in zip(params, flags.tolist(), strict=True):
            if not used:
                p.grad = None

    def _meet(self, run_id: int, aborted: threading.Event) -> None:
        """Waits until every member of the group reached run ``run_id``'s sum, so that no
        member posts a collective that another will never match (see [Note: gradient
        group]); the last to arrive deletes the keys of the group's previous meeting, which
        every member has passed."""
        store = self._meeting
        here, everyone = f"{run_id}", f"{run_id}/all"
        if store.add(here, 1) == self.num_replicas:
            store.set(everyone, "1")
            if self._met is not None:
                store.delete_key(self._met)
                store.delete_key(f"{self._met}/all")
        self._poll(
            lambda: bool(store.check([everyone])),
            aborted,
            longest_pause_s=MEET_POLL_MAX_S,
            aborted_what=f"run {run_id} was aborted before its gradient sum",
            late_what=f"the other replicas of rank {self._rank} did not reach the gradient sum "
            f"of run {run_id}",
        )
        self._met = here

    def _wait(self, run_id: int, works: list[Any], aborted: threading.Event) -> None:
        self._poll(
            lambda: all(w.is_completed() for w in works),
            aborted,
            longest_pause_s=POLL_S,
            aborted_what=f"run {run_id} was aborted during the gradient sum",
            late_what=f"the gradient sum of run {run_id} with the other replicas did not finish",
        )
        for work in works:
            work.wait()  # raises what failed

    def _poll(
        self,
        ready: Callable[[], bool],
        aborted: threading.Event,
        *,
        longest_pause_s: float,
        aborted_what: str,
        late_what: str,
    ) -> None:
        """Waits until ``ready()``, looking again after pauses that double from ``POLL_S`` up
        to ``longest_pause_s``.

        Raises:
            StepAbortedError: ``aborted`` was set (``aborted_what``).
            StageUnavailableError: the group's timeout passed (``late_what``).
        """
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = POLL_S
        while not ready():
            if aborted.wait(pause):
                raise StepAbortedError(aborted_what)
            if time.monotonic() > deadline:
                raise StageUnavailableError(f"{late_what} in {self._timeout.total_seconds():.0f} s")
            pause = min(2 * pause, longest_pause_s)

    def _group_for(self, spec: GroupSpec, aborted: threading.Event) -> Any:
        if spec == self._spec and self._group is not None:
            return self._group
        self._drop()
        host = spec.store_host or self._coordinator_host
        if not host or not spec.store_port:
            raise FailedPreconditionError(
                f"no store to form the gradient group at (host {host!r}, port "
                f"{spec.store_port}): the coordinator serves one to jobs with replicas"
            )
        prefix = group_prefix(self._job_id, self._epoch, spec.generation, self._rank)
        forming = _Forming(lambda: self._form(host, spec.store_port, prefix))
        while not forming.done.wait(0.01):
            if aborted.is_set() and forming.abandon():
                raise StepAbortedError("the run was aborted while its gradient group formed")
        if forming.error is not None:  # torch raises RuntimeError, ValueError for a no-show
            raise StageUnavailableError(
                f"the gradient group of rank {self._rank} ({self.num_replicas} replicas, store "
                f"{host}:{spec.store_port}) did not form: {str(forming.error).splitlines()[0]}"
            ) from forming.error
        assert forming.value is not None
        store, group = forming.value
        self._spec, self._store, self._group = spec, store, group
        self._meeting = _c10d.PrefixStore(f"{prefix}/meet", store)
        self._met = None
        self.formed += 1
        logger.info(
            "job %s: gradient group of rank %d formed (replica %d of %d, generation %d)",
            self._job_id,
            self._rank,
            self.replica,
            self.num_replicas,
            spec.generation,
        )
        return group

    def _form(self, host: str, port: int, prefix: str) -> tuple[Any, Any]:
        store = _c10d.TCPStore(
            host, port, is_master=False, timeout=self._timeout, wait_for_workers=False
        )
        options = _c10d.ProcessGroupGloo._Options()
        options._devices = [_c10d.ProcessGroupGloo.create_device(hostname=self._own_host)]
        options._timeout = self._timeout
        group = _c10d.ProcessGroupGloo(
            _c10d.PrefixStore(prefix, store), self.replica, self.num_replicas, options
        )
        return store, group

    def _drop(self) -> None:
        """Forgets the current group; it is torn down on a daemon thread."""
        group, store = self._group, self._store
        self._spec, self._group, self._store = None, None, None
        if group is not None:
            _teardown(group, store)

    def close(self) -> None:
        """Drops the group (the job left this stage or was re-assigned)."""
        self._drop()


def _teardown(group: Any, store: Any) -> None:
    held = [group, store]  # the store outlives the group's teardown

    def run() -> None:
        try:
            held[0].abort()
        except RuntimeError as exc:  # already broken: nothing more to free
            logger.debug("tearing down a gradient group: %s", exc)
        held.clear()

    threading.Thread(target=run, name="replica-group-teardown", daemon=True).start()


_PARKED: list[tuple[float, list[Any]]] = []
"""Collectives of failed sums, each with the time after which gloo has ended it (see
``_park``)."""
_PARKED_LOCK = threading.Lock()
PARK_MARGIN_S = 5.0
"""Kept this long past the group's timeout before a parked collective is looked at again."""


def _park(works: list[Any], timeout_s: float) -> None:
    """Keeps ``works`` alive: a gloo work dropped, waited on or even asked whether it is done
    while it runs can hold its thread, and the GIL, until the group's timeout. After the
    meeting (``ReplicaGroup._meet``) a sum is left pending only when a member hangs inside
    it, so what is kept here is rare. Gloo ends a collective at the latest when the group's
    ``timeout_s`` has passed (or its group is torn down), so each is kept until then, plus a
    margin, and released by a later park or count once it reports done: what is parked is
    bounded by the failed sums of one timeout, not by the life of the process."""
    with _PARKED_LOCK:
        _release_parked()
        if works:
            _PARKED.append((time.monotonic() + timeout_s + PARK_MARGIN_S, works))


def parked() -> int:
    """How many collectives of failed sums this process still keeps alive (for metrics)."""
    with _PARKED_LOCK:
        _release_parked()
        return sum(len(works) for _, works in _PARKED)


def _release_parked() -> None:
    """Drops parked collectives past their time that are done (called with the lock held)."""
    now = time.monotonic()
    _PARKED[:] = [
        (until, works)
        for until, works in _PARKED
        if until > now or not all(w.is_completed() for w in works)
    ]


class _Forming:
    """A group being formed on a daemon thread; one formed after the run that asked for it
    was abandoned (aborted) is torn down."""

    def __init__(self, form: Callable[[], tuple[Any, Any]]) -> None:
        self.done = threading.Event()
        self.value: tuple[Any, Any] | None = None
        self.error: BaseException | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        threading.Thread(target=self._run, args=(form,), name="replica-group", daemon=True).start()

    def _run(self, form: Callable[[], tuple[Any, Any]]) -> None:
        try:
            value = form()
        except Exception as exc:  # any failure to form is reported to the run
            self.error = exc
            value = None
        with self._lock:
            self.value = value
            self.done.set()
            abandoned = self._abandoned
        if abandoned and value is not None:
            _teardown(value[1], value[0])

    def abandon(self) -> bool:
        """Gives the group up unless it is formed already; True if given up."""
        with self._lock:
            if self.done.is_set():
                return False
            self._abandoned = True
            return True


def _buckets(params: Sequence[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters in buckets of at most ``BUCKET_BYTES`` of float32 (one parameter may be
    more), each bucket of one reduce dtype."""
    buckets: list[list[torch.nn.Parameter]] = []
    size, dtype = 0, None
    for p in params:
        reduce_dtype = _reduce_dtype(p)
        nbytes = p.numel() * torch.finfo(reduce_dtype).bits // 8
        if not buckets or reduce_dtype != dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size, dtype = 0, reduce_dtype
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _reduce_dtype(p: torch.nn.Parameter) -> torch.dtype:
    """Gradients are summed in float32 (float64 ones in float64)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _flatten(bucket: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    dtype = _reduce_dtype(bucket[0])
    parts = [
        torch.zeros(p.numel(), dtype=dtype)
        if p.grad is None
        else p.grad.detach().reshape(-1).to("cpu", dtype)
        for p in bucket
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _unflatten_into(bucket: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in bucket:
        part = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        if p.grad is None:
            p.grad = part.to(p.device, p.dtype).clone()
        else:
            p.grad.copy_(part)
