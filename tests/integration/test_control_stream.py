"""The Control stream between the coordinator and a stage (see [Note: control stream] in
pipesvc/coordinator/control_stream.py), against real stage servers on loopback sockets in
this process: runs, commits and aborts on one long-lived stream per job and stage, typed
errors as over the unary calls, an abort that overtakes a run, a stage without Control, bad
messages, and no threads left behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, cast

import grpc
import pytest
import torch

from pipesvc.coordinator.stage_calls import Deadlines, call_stage
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.coordinator.stage_registry import StageRecord, StageRegistry
from pipesvc.core.config import JobConfig, config_to_proto
from pipesvc.core.limits import Limits
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.plan import PipelineStage
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PipesvcError,
    ResourceExhaustedError,
    StepAbortedError,
    UnauthenticatedError,
    WireFormatError,
)
from pipesvc.stage.server import add_stage_service
from pipesvc.stage.service import StageOptions, StageService
from pipesvc.v1 import common_pb2, stage_pb2
from pipesvc.wire.control_wire import Kind, identity, reply_error, request_bytes
from pipesvc.wire.payload_wire import Payloads
from pipesvc.wire.rpc_status import ERROR_CLASS_KEY
from pipesvc.wire.security import Security
from pipesvc.wire.transport import check_health, create_server, open_channel
from tests.support.reference import PROBLEMS, Reference
from tests.support.stage_probe import stage_info

MLP = PROBLEMS["mlp"]
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
CONFIG = JobConfig(
    model="mlp",
    model_args=MLP.model_args,
    seed=11,
    num_stages=1,
    num_microbatches=2,
    loss="mse",
    optimizer=OPTIMIZER,
)
DEADLINES = Deadlines(control_s=20.0, step_s=60.0, abort_s=5.0, health_interval_s=0.5)


@dataclass
class Stage:
    """A stage server in this process."""

    address: str
    service: StageService
    server: grpc.Server


def _name_stage_thread() -> None:
    threading.current_thread().name = f"stage-{threading.current_thread().name}"


@pytest.fixture
def start_stage() -> Iterator[Callable[..., Stage]]:
    started: list[Stage] = []

    def start(
        *, serve_control: bool = True, limits: Limits | None = None, token: str | None = None
    ) -> Stage:
        limits = limits or Limits()
        security = Security(token=token)
        options = StageOptions(
            address="",
            device=torch.device("cpu"),
            memory_bytes=1 << 30,
            limits=limits,
            recv_timeout_s=120.0,
            security=security,
        )
        service = StageService(options)
        server, port, _ = create_server(
            "127.0.0.1:0",
            [lambda s: add_stage_service(service, s, serve_control=serve_control)],
            limits=limits,
            security=security,
            thread_initializer=_name_stage_thread,
        )
        service.advertise(f"127.0.0.1:{port}", "127.0.0.1")
        stage = Stage(f"127.0.0.1:{port}", service, server)
        started.append(stage)
        return stage

    yield start
    for stage in started:
        stage.server.stop(grace=None).wait()
        stage.service.close()


@pytest.fixture
def registry() -> Iterator[StageRegistry]:
    made = StageRegistry()
    yield made
    made.close()


def _assign(address: str, *, rank: int = 0, num_stages: int = 1, epoch: int = 1) -> None:
    """Gives the stage its share of the MLP job ``j`` (rank ``rank`` of ``num_stages``)."""
    per = 4 // num_stages
    plan = [
        common_pb2.PlanStage(start_layer=r * per, end_layer=(r + 1) * per, rank=r, address=address)
        for r in range(num_stages)
    ]
    request = stage_pb2.AssignRequest(
        job_id="j",
        plan_epoch=epoch,
        spec=config_to_proto(CONFIG),
        stage=plan[rank],
        num_stages=num_stages,
        downstream_address="" if rank == num_stages - 1 else "127.0.0.1:1",
        plan=plan,
    )
    registry = StageRegistry()
    try:
        call_stage(
            registry,
            PipelineStage(start_layer=0, end_layer=4, rank=rank, address=address),
            lambda stub: stub.Assign,
            request,
            30.0,
        )
    finally:
        registry.close()


def _group(registry: StageRegistry, address: str, pool: futures.ThreadPoolExecutor) -> StageGroup:
    return StageGroup(
        job_id="j",
        config=CONFIG,
        layers=[],
        plan=[PipelineStage(start_layer=0, end_layer=4, rank=0, address=address)],
        epoch=1,
        registry=registry,
        deadlines=DEADLINES,
        pool=pool,
    )


def _register(registry: StageRegistry, address: str) -> None:
    registry.register(
        StageRecord(address=address, device="cpu", memory_bytes=1 << 30, models=("mlp",))
    )


def test_steps_runs_commits_and_aborts_share_one_stream(
    start_stage: Callable[..., Stage], registry: StageRegistry
) -> None:
    """Eight training steps (each run carrying the last one's commit), an aborted run, an
    inference run and an explicit commit all travel on one Control stream, with the one-process
    oracle's losses; the unary calls are not used for any of them."""
    stage = start_stage()
    _assign(stage.address)
    _register(registry, stage.address)
    reference = Reference(MLP, seed=11, optimizer=OPTIMIZER, clip_grad_norm=None)
    with futures.ThreadPoolExecutor(4) as pool:
        group = _group(registry, stage.address, pool)
        run_id, pending = 0, None
        for number in range(8):
            x, y = MLP.batch(6 + number % 3, seed=number)
            run_id += 1
            commit = None if pending is None else stage_pb2.CarriedCommit(run_id=pending)
            replies = group.run_step(
                run_id, stage_pb2.TRAIN, RunBatch.split(x, y, None, 2), what="t", commit=commit
            )
            assert sum(replies.losses) == pytest.approx(reference.step(x, y, 2), rel=1e-5, abs=1e-6)
            pending = run_id
        group.commit(stage_pb2.CommitRequest(job_id="j", plan_epoch=1, run_id=run_id), step=8)
        assert stage_info(stage.address).step == 8
        run_id += 1
        group.abort(run_id)
        run_id += 1
        x, _ = MLP.batch(4, seed=99)
        replies = group.run_step(
            run_id, stage_pb2.INFER, RunBatch.split(x, None, None, 2), what="i"
        )
        assert len(replies.outputs) == 2
    info = stage_info(stage.address)
    assert (info.control_streams_opened, info.control_streams_open) == (1, 1)
    assert registry.control.opened == 1
    assert info.last_run_id == run_id


def _commit(stub: Any) -> Any:
    return stub.Commit


def _abort(stub: Any) -> Any:
    return stub.Abort


def test_errors_over_the_stream_are_the_unary_calls_errors(
    start_stage: Callable[..., Stage], registry: StageRegistry
) -> None:
    """Each refusal arrives as the same class with the same message as over the unary call."""
    stage = start_stage()
    _assign(stage.address)
    plan_stage = PipelineStage(start_layer=0, end_layer=4, rank=0, address=stage.address)
    cases: list[tuple[Kind, Any, Callable[[Any], Any]]] = [
        ("commit", stage_pb2.CommitRequest(job_id="j", plan_epoch=1, run_id=5), lambda s: s.Commit),
        ("commit", stage_pb2.CommitRequest(job_id="j", plan_epoch=7, run_id=5), lambda s: s.Commit),
        (
            "abort",
            stage_pb2.AbortRequest(job_id="other", plan_epoch=1, run_id=5),
            lambda s: s.Abort,
        ),
        (
            "run",
            stage_pb2.RunStepRequest(job_id="j", plan_epoch=1, run_id=9, mode=stage_pb2.TRAIN),
            lambda s: s.RunStep,
        ),
        (
            "run",
            stage_pb2.RunStepRequest(
                job_id="j", plan_epoch=1, run_id=9, mode=cast("stage_pb2.RunMode.ValueType", 77)
            ),
            lambda s: s.RunStep,
        ),
    ]
    seen: set[type[PipesvcError]] = set()
    for kind, message, method in cases:
        with pytest.raises(PipesvcError) as unary:
            call_stage(registry, plan_stage, method, message, 10.0)
        future = registry.control.send(
            stage.address, job_id="j", epoch=1, kind=kind, message=message, timeout_s=10.0
        )
        streamed = future.exception(timeout=10.0)
        assert type(streamed) is type(unary.value)
        assert f"stage rank 0 ({stage.address}): {streamed}" == str(unary.value)
        seen.add(type(streamed))
    assert seen == {FailedPreconditionError, NotFoundError, InvalidArgumentError}
    assert registry.control.opened == 1


def test_an_abort_overtakes_the_run_it_aborts(
    start_stage: Callable[..., Stage], registry: StageRegistry
) -> None:
    """The last of two stages runs a training run whose activations never come (its upstream
    is gone); the abort sent on the same stream is handled while the run waits, and ends it
    (handled one after the other, the abort would wait out the run's 120 s receive deadline)."""
    stage = start_stage()
    _assign(stage.address, rank=1, num_stages=2)
    payloads = Payloads()
    run = stage_pb2.RunStepRequest(
        job_id="j",
        plan_epoch=1,
        run_id=1,
        mode=stage_pb2.TRAIN,
        num_microbatches=1,
        targets=[payloads.tensor(torch.zeros(2, 3))],
        loss_weights=[1.0],
    )
    running = registry.control.send(
        stage.address,
        job_id="j",
        epoch=1,
        kind="run",
        message=run,
        payloads=payloads.views,
        timeout_s=60.0,
    )
    time.sleep(0.5)  # the run is waiting for its first activation
    assert not running.done()
    aborted = registry.control.send(
        stage.address,
        job_id="j",
        epoch=1,
        kind="abort",
        message=stage_pb2.AbortRequest(job_id="j", plan_epoch=1, run_id=1),
        timeout_s=10.0,
    )
    assert aborted.result(timeout=20.0) == stage_pb2.AbortResponse()
    assert isinstance(running.exception(timeout=20.0), StepAbortedError)
    assert registry.control.opened == 1


def test_a_stage_without_control_gets_the_unary_calls(
    start_stage: Callable[..., Stage], registry: StageRegistry
) -> None:
    """A stage built before Control answers UNIMPLEMENTED: the message is sent again as its
    unary call, and so is every later one, with the same results and typed errors."""
    old = start_stage(serve_control=False)
    _assign(old.address)
    _register(registry, old.address)
    reference = Reference(MLP, seed=11, optimizer=OPTIMIZER, clip_grad_norm=None)
    with futures.ThreadPoolExecutor(4) as pool:
        group = _group(registry, old.address, pool)
        for number in range(3):
            x, y = MLP.batch(6, seed=number)
            commit = None if number == 0 else stage_pb2.CarriedCommit(run_id=number)
            replies = group.run_step(
                number + 1, stage_pb2.TRAIN, RunBatch.split(x, y, None, 2), what="t", commit=commit
            )
            assert sum(replies.losses) == pytest.approx(reference.step(x, y, 2), rel=1e-5, abs=1e-6)
        group.commit(stage_pb2.CommitRequest(job_id="j", plan_epoch=1, run_id=3), step=3)
    refused = registry.control.send(
        old.address,
        job_id="j",
        epoch=1,
        kind="commit",
        message=stage_pb2.CommitRequest(job_id="j", plan_epoch=9, run_id=3),
        timeout_s=10.0,
    )
    error = refused.exception(timeout=10.0)
    assert isinstance(error, FailedPreconditionError) and "plan epoch 9" in str(error)
    assert stage_info(old.address).step == 3
    assert registry.control.opened == 1  # tried once, then unary calls only
    assert stage_info(old.address).control_streams_opened == 0


def test_a_stream_needs_the_token(start_stage: Callable[..., Stage]) -> None:
    """A stage with a token refuses a stream without it, typed as a unary call's refusal; the
    coordinator's channel adds it to streams as to every call."""
    stage = start_stage(token="s3cret")
    abort = stage_pb2.AbortRequest(job_id="j", plan_epoch=1, run_id=1)
    for token, expected in ((None, UnauthenticatedError), ("s3cret", NotFoundError)):
        registry = StageRegistry(security=Security(token=token))
        try:
            future = registry.control.send(
                stage.address, job_id="j", epoch=1, kind="abort", message=abort, timeout_s=10.0
            )
            assert type(future.exception(timeout=10.0)) is expected
        finally:
            registry.close()


def _raw_stream(address: str) -> tuple[Any, Callable[[bytes | None], None]]:
    """A Control call of raw bytes: its replies, and a function that sends (None: ends)."""
    outgoing: list[bytes | None] = []
    ready = threading.Condition()

    def requests() -> Iterator[bytes]:
        while True:
            with ready:
                ready.wait_for(lambda: bool(outgoing))
                item = outgoing.pop(0)
            if item is None:
                return
            yield item

    def send(item: bytes | None) -> None:
        with ready:
            outgoing.append(item)
            ready.notify_all()

    channel = open_channel(address)
    method = channel.stream_stream(
        "/pipesvc.v1.StageService/Control",
        request_serializer=identity,
        response_deserializer=stage_pb2.ControlReply.FromString,
    )
    return method(requests(), timeout=30), send


def test_bad_messages_get_typed_errors_and_the_stage_serves_on(
    start_stage: Callable[..., Stage], registry: StageRegistry
) -> None:
    """A message of no known kind gets InvalidArgumentError under its id and the stream goes
    on; one the stage's message limit refuses, and bytes that do not parse, end only their
    stream, with typed errors; the stage stays up and serves the next stream."""
    stage = start_stage(limits=Limits(max_message_bytes=64 << 10))
    replies, send = _raw_stream(stage.address)
    send(b"\x08\x07" + b"\x4a\x02hi")  # id 7, and an unknown field 9
    send(request_bytes(8, "abort", stage_pb2.AbortRequest(job_id="j", run_id=1)))
    first, second = next(replies), next(replies)
    assert first.id == 7 and second.id == 8
    assert isinstance(reply_error(first, ""), InvalidArgumentError)
    assert "no run, commit or abort" in first.error.message
    assert isinstance(reply_error(second, ""), NotFoundError)
    send(b"\x08\x09\x12\xff")  # id 9, then a run whose length runs past the end
    unreadable = next(replies)
    assert unreadable.id == 9 and isinstance(reply_error(unreadable, ""), WireFormatError)
    send(b"\xff\xff")  # not even an id
    with pytest.raises(grpc.RpcError) as ended:
        next(replies)
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailing: Any = ended.value.trailing_metadata() or ()
    assert dict(trailing)[ERROR_CLASS_KEY] == "WireFormatError"
    send(None)

    # Over the stage's limit: the stream ends RESOURCE_EXHAUSTED, the next one serves.
    payloads = Payloads()
    big = stage_pb2.RunStepRequest(
        job_id="j", run_id=1, num_microbatches=1, inputs=[payloads.tensor(torch.zeros(1 << 15))]
    )
    future = registry.control.send(
        stage.address,
        job_id="j",
        epoch=1,
        kind="run",
        message=big,
        payloads=payloads.views,
        timeout_s=10.0,
    )
    assert isinstance(future.exception(timeout=10.0), ResourceExhaustedError)
    abort = stage_pb2.AbortRequest(job_id="j", plan_epoch=1, run_id=1)
    again = registry.control.send(
        stage.address, job_id="j", epoch=1, kind="abort", message=abort, timeout_s=10.0
    )
    assert isinstance(again.exception(timeout=10.0), NotFoundError)
    assert registry.control.opened == 2
    assert check_health(stage.address).name == "SERVING"

    # Over the coordinator's own limit: refused before it is sent; the stream stays.
    small = StageRegistry(limits=Limits(max_message_bytes=1 << 10))
    try:
        refused = small.control.send(
            stage.address,
            job_id="j",
            epoch=1,
            kind="run",
            message=big,
            payloads=payloads.views,
            timeout_s=10.0,
        )
        assert isinstance(refused.exception(timeout=10.0), ResourceExhaustedError)
        after = small.control.send(
            stage.address, job_id="j", epoch=1, kind="abort", message=abort, timeout_s=10.0
        )
        assert isinstance(after.exception(timeout=10.0), NotFoundError)
        assert small.control.opened == 1
    finally:
        small.close()


def _control_threads(prefix: str = "control-stream-") -> list[str]:
    """The coordinator's stream readers (the stages here run ``control-reader`` threads)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_streams_close_with_the_epoch_the_job_and_the_coordinator(
    start_stage: Callable[..., Stage],
) -> None:
    """A new plan epoch closes the job's streams of the old one; releasing the job closes the
    rest, on both ends, and no thread is left behind; so does closing the registry."""
    stages = [start_stage(), start_stage()]
    registry = StageRegistry()
    for stage in stages:  # the channels and their threads exist before the count
        assert registry.health(stage.address, 5.0).name == "SERVING"
    baseline = _thread_count()

    def abort_on_all(epoch: int) -> None:
        for stage in stages:
            future = registry.control.send(
                stage.address,
                job_id="j",
                epoch=epoch,
                kind="abort",
                message=stage_pb2.AbortRequest(job_id="j", plan_epoch=epoch, run_id=1),
                timeout_s=10.0,
            )
            assert isinstance(future.exception(timeout=10.0), NotFoundError)

    try:
        abort_on_all(1)
        abort_on_all(1)
        assert registry.control.opened == 2
        assert len(_control_threads()) == 2
        group = StageGroup(
            job_id="j",
            config=CONFIG,
            layers=[],
            plan=[
                PipelineStage(start_layer=0, end_layer=4, rank=0, address=s.address) for s in stages
            ],
            epoch=1,
            registry=registry,
            deadlines=DEADLINES,
            pool=futures.ThreadPoolExecutor(1),
        )
        group.epoch = 2  # as a recovery does
        assert registry.control.open_count() == 0
        abort_on_all(2)
        assert (registry.control.opened, registry.control.open_count()) == (4, 2)
        registry.release("j")
        assert registry.control.open_count() == 0
        _wait_for(lambda: all(stage_info(s.address).control_streams_open == 0 for s in stages))
        assert [stage_info(s.address).control_streams_opened for s in stages] == [2, 2]
        assert _control_threads() == []
        _wait_for(lambda: _control_threads("control-reader") == [])
        _wait_for(lambda: _thread_count() <= baseline)
        abort_on_all(3)
    finally:
        registry.close()
    assert _control_threads() == []
    _wait_for(lambda: all(stage_info(s.address).control_streams_open == 0 for s in stages))
    _wait_for(lambda: _thread_count() <= baseline)


def _thread_count() -> int:
    """The coordinator's threads: not the stages' request threads (``stage-``: the server's
    pool keeps them) nor their control workers (``control_N``: at most ``CONTROL_WORKERS``,
    kept for their next message)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith(("control_", "stage-")))


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_closed_stage_service_leaves_no_control_worker_behind(
    start_stage: Callable[..., Stage], registry: StageRegistry
) -> None:
    """A stage's Control workers (``control_N``) live as long as its service: once its server
    stopped and the service closed (as ``run_stage`` does on its way out), none is left, and
    the job it held is closed."""
    before = {t for t in threading.enumerate() if t.name.startswith("control_")}
    stage = start_stage()
    _assign(stage.address)
    _register(registry, stage.address)
    with futures.ThreadPoolExecutor(2) as pool:
        group = _group(registry, stage.address, pool)
        x, y = MLP.batch(6, seed=0)
        group.run_step(1, stage_pb2.TRAIN, RunBatch.split(x, y, None, 2), what="t")
    workers = {t for t in threading.enumerate() if t.name.startswith("control_")} - before
    assert workers  # the run was handled on them
    registry.close()
    stage.server.stop(grace=None).wait()
    stage.service.close()
    assert not stage.service.holds_job
    for worker in workers:
        worker.join(timeout=10.0)
    assert not any(w.is_alive() for w in workers)
    stage.service.close()  # twice: nothing happens
