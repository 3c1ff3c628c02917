"""Calls from the coordinator to its stages: deadlines, typed errors, and a health watchdog.

[Note: detection] While a pipelined call runs on every stage, the coordinator health-checks the
stages it is still waiting on every ``health_interval_s``. A stage that fails
``health_failures`` checks in a row (killed, hung, or cut off) is declared lost: every pending
call is cancelled and StageLostError names it, so a stuck step never waits for its deadline.
The checks before a call and after a failed one (``patient_health``) count unanswered checks
the same way, so a stage that pauses for less than that is never replaced; one that refuses the
connection (its process is gone) is lost at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, TypeVar, overload

import grpc

from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.core.health import Health
from pipesvc.core.option_flags import flag
from pipesvc.core.plan import PipelineStage
from pipesvc.errors import (
    PipelineTimeoutError,
    PipesvcError,
    StageUnavailableError,
    StepAbortedError,
)
from pipesvc.v1 import stage_pb2_grpc
from pipesvc.wire.rpc_status import error_from_rpc, rpc_errors
from pipesvc.wire.transport import call

logger = logging.getLogger(__name__)

StageStub: TypeAlias = stage_pb2_grpc.StageServiceStub
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Co = TypeVar("_Co", covariant=True)
# A string: grpc's classes are generic only in its stubs, not at run time.
UnaryMethod: TypeAlias = "Callable[[StageStub], grpc.UnaryUnaryMultiCallable[_Req, _Resp]]"
"""Picks a unary method off a stub (``lambda stub: stub.Commit``): mypy then checks the
method's name, its request type and its reply type at the call site."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Deadlines:
    """Deadlines and fault-detection settings of the coordinator's outbound calls."""

    control_s: float = field(default=120.0, metadata=flag("--control-timeout-s"))
    """Deadline of assign, commit, abort and state calls."""
    step_s: float = field(default=600.0, metadata=flag("--step-timeout-s"))
    """Deadline of one pipelined step on a stage."""
    abort_s: float = 5.0
    """An Abort (sent to stages that may be dead)."""
    health_s: float = 1.0
    """One health check."""
    health_interval_s: float = field(default=1.0, metadata=flag())
    """Health-check the stages a step waits on this often."""
    health_failures: int = field(default=2, metadata=flag())
    """Missed health checks in a row that declare a stage lost."""
    reconcile_s: float = 30.0
    """After a coordinator restart: how long to wait for a job's stages to re-register."""


class StageLostError(StageUnavailableError):
    """One or more stages stopped answering (killed, hung or cut off)."""

    def __init__(self, message: str, addresses: set[str]) -> None:
        super().__init__(message)
        self.addresses = addresses


def where(stage: PipelineStage) -> str:
    """How errors name a stage: its rank and address."""
    return f"stage rank {stage.rank} ({stage.address})"


def _named(error: PipesvcError, stage: PipelineStage) -> PipesvcError:
    if where(stage) in str(error):
        return error
    named = type(error)(f"{where(stage)}: {error}")
    named.__dict__.update(error.__dict__)  # what a typed error carries (lost sessions)
    named.__cause__ = error
    return named


@overload
def call_stage(
    registry: StageRegistry,
    stage: PipelineStage,
    method: UnaryMethod[_Req, _Resp],
    request: _Req,
    timeout_s: float,
) -> _Resp: ...


@overload
def call_stage(
    registry: StageRegistry,
    stage: PipelineStage,
    method: Callable[[StageStub], grpc.StreamUnaryMultiCallable[_Req, _Resp]],
    request: Iterator[_Req],
    timeout_s: float,
) -> _Resp: ...


def call_stage(
    registry: StageRegistry,
    stage: PipelineStage,
    method: Callable[[StageStub], Any],
    request: Any,
    timeout_s: float,
) -> Any:
    """Calls ``method(stub)`` (a unary or request-streaming method of the stage's stub, e.g.
    ``lambda stub: stub.Abort``) with a deadline; errors keep their class and name the stage.

    Raises:
        PipesvcError: what the stage raised, or StageUnavailableError if it was unreachable.
    """
    stub = registry.stub(stage.address)
    try:
        return call(method(stub), request, timeout_s=timeout_s, where=where(stage))
    except PipesvcError as exc:
        raise _named(exc, stage) from exc


def health_of(
    registry: StageRegistry, addresses: Sequence[str], timeout_s: float
) -> dict[str, Health]:
    """Each address's health status, checked in parallel."""
    return _parallel(lambda a: registry.health(a, timeout_s), addresses)


def patient_health(
    registry: StageRegistry,
    addresses: Sequence[str],
    deadlines: Deadlines,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Health]:
    """Each address's health, where UNREACHABLE means the stage is gone (its connection
    refused or closed) or left ``health_failures`` checks in a row, ``health_interval_s`` apart,
    unanswered, as the watchdog counts ([Note: detection]).

    A stage that leaves a check unanswered is checked again, and a later answer is its status.
    So a stage that stops for a moment (a long pause, a busy host, a lost packet) is not taken
    for lost by the check before a call or after a failed one; a killed one, whose host
    refuses the connection, is found at once.
    """
    statuses: dict[str, Health] = {}
    waiting = list(addresses)
    for attempt in range(max(deadlines.health_failures, 1)):
        if attempt:
            logger.warning(
                "%s did not answer a health check; checking again in %.1f s",
                ", ".join(waiting),
                deadlines.health_interval_s,
            )
            sleep(deadlines.health_interval_s)
        checks = _parallel(lambda a: registry.health_check(a, deadlines.health_s), waiting)
        statuses.update((a, health) for a, (health, _) in checks.items())
        waiting = [a for a, (h, gone) in checks.items() if h == Health.UNREACHABLE and not gone]
        if not waiting:
            break
    return statuses


def _parallel(check: Callable[[str], _Resp], addresses: Sequence[str]) -> dict[str, _Resp]:
    """``check`` of each address, run in parallel."""
    if not addresses:
        return {}
    with futures.ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return dict(zip(addresses, pool.map(check, addresses), strict=True))


def stream_stage(
    registry: StageRegistry,
    stage: PipelineStage,
    method: Callable[[StageStub], grpc.UnaryStreamMultiCallable[_Req, _Resp]],
    request: _Req,
    timeout_s: float,
    *,
    deadlines: Deadlines,
    what: str,
) -> Iterator[_Resp]:
    """The replies of a server-streaming call on one stage, under the health watchdog.

    A stage that is killed, stopped or cut off while it streams (its state into a checkpoint,
    say) is found by health checks as in a pipelined call (see [Note: detection]), and the
    call is cancelled, rather than waiting for ``timeout_s``. Closing the iterator early
    cancels the call too.

    Raises:
        StageLostError: the watchdog declared the stage lost.
        PipesvcError: what the stage raised, naming it.
    """
    replies = method(registry.stub(stage.address))(request, timeout=timeout_s)
    done = threading.Event()
    lost = threading.Event()

    def watch() -> None:
        failures: dict[int, int] = {}
        while not done.wait(deadlines.health_interval_s):
            if _watch(registry, [stage], [0], failures, deadlines):
                lost.set()
                replies.cancel()
                return

    threading.Thread(target=watch, name=f"watch-{stage.address}", daemon=True).start()
    try:
        with rpc_errors(where(stage)):
            yield from replies
    except PipesvcError as exc:
        if lost.is_set():
            raise StageLostError(
                f"{where(stage)} stopped answering health checks during {what}",
                {stage.address},
            ) from exc
        named = _named(exc, stage)
        if named is exc:
            raise  # as rpc_errors raised it, chained to the RpcError
        raise named from exc
    finally:
        done.set()
        replies.cancel()


def call_all(
    registry: StageRegistry,
    plan: Sequence[PipelineStage],
    make: Callable[
        [StageStub, PipelineStage], tuple[grpc.UnaryUnaryMultiCallable[_Req, _Resp], _Req]
    ],
    timeout_s: float,
    *,
    deadlines: Deadlines | None = None,
    what: str = "",
) -> list[_Resp]:
    """Calls a unary method on every stage of ``plan`` (all of a job's, or some) at once;
    returns the replies in the order of ``plan``. ``make(stub, stage)`` gives the method and
    the request for a stage, e.g. ``lambda stub, s: (stub.Commit, request)``.

    With ``deadlines``, a watchdog health-checks the stages still running (see [Note:
    detection]). On the first failure the other calls are left to finish (a caller aborts them).

    Raises:
        StageLostError: the watchdog declared a stage lost (pending calls are cancelled).
        PipesvcError: the first root-cause error of any stage, naming it.
    """
    calls: list[Reply[_Resp]] = []
    for stage in plan:
        method, request = make(registry.stub(stage.address), stage)
        calls.append(method.future(request, timeout=timeout_s))
    return gather(registry, plan, calls, deadlines=deadlines, what=what)


class Reply(Protocol[_Co]):
    """The future of one stage's reply: a unary call's ``grpc.Future``, or a Control stream
    message's ``concurrent.futures.Future`` (see [Note: control stream] in control_stream.py)."""

    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def cancel(self) -> bool: ...
    def result(self, timeout: float | None = None) -> _Co: ...
    def exception(self, timeout: float | None = None) -> BaseException | None: ...
    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


class Meanwhile(Protocol):
    """Work a wait for replies does as it becomes possible (sending the next step's run ahead,
    see [Note: steps ahead] in step_runner.py)."""

    def watch(self, wake: Callable[[], None] | None) -> None:
        """Has ``wake`` called, from any thread, whenever there may be work (None: stop)."""
        ...

    def __call__(self) -> bool:
        """Does the work if it can now; True once there is none left."""
        ...


def gather(
    registry: StageRegistry,
    plan: Sequence[PipelineStage],
    calls: Sequence[Reply[_Resp]],
    *,
    deadlines: Deadlines | None = None,
    what: str = "",
    timeout_s: float | None = None,
    meanwhile: Meanwhile | None = None,
) -> list[_Resp]:
    """Waits for ``calls`` (one per stage of ``plan``, in its order) as ``call_all`` does:
    under the watchdog with ``deadlines``, returning on the first failure; the replies in the
    order of ``plan``. ``timeout_s`` is the deadline of futures that have none of their own
    (a Control stream's): past it the pending ones are cancelled and the first of them fails
    as a unary call past its deadline would. ``meanwhile`` is called first and then whenever
    it wakes the wait, until it says it is done or the calls end.

    Raises:
        StageLostError: the watchdog declared a stage lost (pending calls are cancelled).
        PipelineTimeoutError: ``timeout_s`` passed with calls pending.
        PipesvcError: the first root-cause error of any stage, naming it; or what
            ``meanwhile`` raised.
    """
    cond = threading.Condition()
    for future in calls:
        future.add_done_callback(lambda _f: _notify(cond))
    bell = _Bell(cond, meanwhile)
    try:
        return _gather(registry, plan, calls, bell, deadlines, what, timeout_s)
    finally:
        if meanwhile is not None:
            meanwhile.watch(None)


class _Bell:
    """``gather``'s ``meanwhile`` and whether it rang: it rings first, then on each wake, and
    no wake is lost between a look and the wait that follows it."""

    def __init__(self, cond: threading.Condition, meanwhile: Meanwhile | None) -> None:
        self.cond, self._meanwhile = cond, meanwhile
        self._rung = meanwhile is not None
        """Rung and not yet taken (read and written under ``cond``)."""
        if meanwhile is not None:
            meanwhile.watch(self._ring)

    def _ring(self) -> None:
        with self.cond:
            self._rung = True
            self.cond.notify_all()

    def take(self) -> bool:
        """Whether it rang since the last take (call under ``cond``)."""
        rung, self._rung = self._rung, False
        return rung

    def answer(self) -> None:
        """Calls ``meanwhile`` (outside ``cond``: it may send calls); once it is done, lets
        go of its watch, so that nothing rings again."""
        meanwhile = self._meanwhile
        if meanwhile is not None and meanwhile():
            meanwhile.watch(None)
            self._meanwhile = None


def _gather(
    registry: StageRegistry,
    plan: Sequence[PipelineStage],
    calls: Sequence[Reply[_Resp]],
    bell: _Bell,
    deadlines: Deadlines | None,
    what: str,
    timeout_s: float | None,
) -> list[_Resp]:
    cond = bell.cond
    failures: dict[int, int] = {}
    started = time.monotonic()
    next_check = started + (deadlines.health_interval_s if deadlines else 0)
    ends_at = None if timeout_s is None else started + timeout_s
    while True:
        with cond:
            pending = [r for r, f in enumerate(calls) if not f.done()]
            failed = [r for r, f in enumerate(calls) if f.done() and _error(f) is not None]
            # Nothing goes ahead of a run known to have failed; one whose replies are all in
            # still gets its turn (the step is not decided yet).
            rung = not failed and bell.take()
            if pending and not failed and not rung:
                cond.wait(timeout=0.25 if deadlines or ends_at is not None else None)
        if rung:
            bell.answer()
        if not pending or failed:
            break
        now = time.monotonic()
        if ends_at is not None and now >= ends_at:
            late = [r for r, f in enumerate(calls) if not f.done()]
            if late:
                for pending_call in calls:
                    pending_call.cancel()
                raise _named(PipelineTimeoutError("Deadline Exceeded"), plan[late[0]])
        if deadlines and now >= next_check:
            next_check = time.monotonic() + deadlines.health_interval_s
            lost = _watch(registry, plan, pending, failures, deadlines)
            if lost:
                for pending_call in calls:
                    pending_call.cancel()
                names = ", ".join(where(plan[r]) for r in lost)
                raise StageLostError(
                    f"{names} stopped answering health checks during {what or 'a call'}; "
                    f"it was still running there",
                    {plan[r].address for r in lost},
                )
    errors = [(r, _error(f)) for r, f in enumerate(calls) if f.done()]
    found = [(r, e) for r, e in errors if e is not None]
    if found:
        # The root cause is the first error that is not a consequence of an abort.
        index, root = next(
            ((i, e) for i, e in found if not isinstance(e, StepAbortedError)), found[0]
        )
        assert root is not None
        raise _named(root, plan[index])
    return [f.result() for f in calls]


def _notify(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()


def _error(future: Reply[Any]) -> PipesvcError | None:
    if future.cancelled():
        return StepAbortedError("the call was cancelled")
    exc = future.exception()
    if exc is None:
        return None
    if isinstance(exc, PipesvcError):  # a Control stream's reply, typed already
        return exc
    if isinstance(exc, grpc.RpcError):
        return error_from_rpc(exc)
    return StageUnavailableError(str(exc))


def _watch(
    registry: StageRegistry,
    plan: Sequence[PipelineStage],
    pending: list[int],
    failures: dict[int, int],
    deadlines: Deadlines,
) -> list[int]:
    statuses = health_of(registry, [plan[r].address for r in pending], deadlines.health_s)
    lost = []
    for index in pending:
        if statuses[plan[index].address] == Health.UNREACHABLE:
            failures[index] = failures.get(index, 0) + 1
            logger.warning(
                "%s missed a health check (%d in a row)", where(plan[index]), failures[index]
            )
            if failures[index] >= deadlines.health_failures:
                lost.append(index)
        else:
            failures[index] = 0
    return lost
