"""Running a stage server: bind, register with the coordinator, serve until stopped."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable

import grpc
import torch
from grpc_health.v1 import health_pb2

from pipesvc import models
from pipesvc.core.health import Health
from pipesvc.core.version import VERSION
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PipesvcError,
    StageUnavailableError,
)
from pipesvc.stage.dataplane.frame_wire import parse, serialize
from pipesvc.stage.service import StageOptions, StageService
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2_grpc
from pipesvc.wire.control_wire import parse_request, reply_bytes
from pipesvc.wire.diagnose import explain
from pipesvc.wire.payload_wire import RUN_STEP
from pipesvc.wire.protocol import WIRE_PROTOCOL, check_coordinator
from pipesvc.wire.rpc_status import rpc_errors
from pipesvc.wire.security import Security
from pipesvc.wire.transport import (
    Codec,
    add_service,
    check_health,
    create_server,
    open_channel,
    split_address,
)

logger = logging.getLogger(__name__)


def stage_device(name: str | None = None) -> torch.device:
    """The device a stage computes on: ``name`` (``cpu``, ``cuda`` or ``cuda:N``), or CUDA when
    one is available and the CPU otherwise. The result always has an index when it is CUDA
    (``cuda`` alone means the current device, ``cuda:0`` on a fresh process): CUDA's calls that
    pin a device refuse one without.

    Raises:
        InvalidArgumentError: ``name`` is no device, or names a CUDA device this host lacks.
    """
    if not name:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgumentError(
            f"device {name!r} is not a device: expected cpu, cuda or cuda:N"
        ) from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidArgumentError(f"device {name!r}: a stage runs on cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InvalidArgumentError(
            f"device {name!r}: this host has no CUDA device that torch {torch.__version__} can "
            f"use (use --device cpu, or install a CUDA build of torch)"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise InvalidArgumentError(
            f"device {name!r}: this host has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def device_memory_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now: the default memory budget of a stage."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def add_stage_service(
    servicer: stage_pb2_grpc.StageServiceServicer,
    server: grpc.Server,
    *,
    serve_control: bool = True,
) -> None:
    """Registers the stage service on ``server`` with Exchange's frames (see [Note: frame
    wire]) and the tensors of RunStep and Control runs (see [Note: payload wire])
    (de)serialized without copying payloads through protobuf. Without ``serve_control`` the
    stage has no Control method, as one built before it (a seam for version-skew tests)."""
    add_service(
        lambda s: stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, s),
        server,
        {
            "Exchange": Codec(request_deserializer=parse, response_serializer=serialize),
            "RunStep": Codec(request_deserializer=RUN_STEP.parse),
            "Control": Codec(request_deserializer=parse_request, response_serializer=reply_bytes),
        },
        without=() if serve_control else ("Control",),
    )


def register(
    coordinator: str,
    address: str,
    device: torch.device,
    timeout_s: float,
    security: Security,
    memory_bytes: int,
) -> None:
    """Announces this stage to the coordinator, waiting up to ``timeout_s`` for it to be up.

    Raises:
        StageUnavailableError: the coordinator did not answer in time.
        FailedPreconditionError: the coordinator refused this stage, or it runs another
            pipesvc version (see [Note: wire protocol] in ``pipesvc.wire.protocol``).
    """
    request = coordinator_pb2.RegisterStageRequest(
        address=address,
        device=str(device),
        memory_bytes=memory_bytes,
        models=models.known_models(),
        protocol=WIRE_PROTOCOL,
        version=VERSION,
    )
    with open_channel(coordinator, security) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)

        def convert(exc: grpc.RpcError) -> PipesvcError:
            # Explained (e.g. "is a pipesvc stage, not a coordinator"); unavailable, so the
            # heartbeat goes on trying, unless the coordinator refused this stage's version.
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return FailedPreconditionError(f"could not register: {exc.details()}")
            error = explain(
                exc, what="coordinator", address=coordinator, channel=channel, security=security
            )
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # waited for it to be ready
                return StageUnavailableError(
                    f"could not register: the coordinator at {coordinator} did not answer in "
                    f"{timeout_s:g} s. Check its address and port, that it is running, and "
                    "that TLS is on for both sides or neither"
                )
            kind = type(error) if isinstance(error, StageUnavailableError) else None
            return (kind or StageUnavailableError)(f"could not register: {error}")

        with rpc_errors(convert=convert):
            reply = stub.RegisterStage(request, timeout=timeout_s, wait_for_ready=True)
    check_coordinator(coordinator, reply.protocol, reply.version)


def _heartbeat(
    coordinator: str,
    address: str,
    device: torch.device,
    security: Security,
    interval_s: float,
    stop: threading.Event,
    memory_bytes: int,
) -> None:
    """Re-registers every ``interval_s`` so a restarted coordinator learns of this stage (a
    refusal, e.g. by a coordinator of another version, is logged when new and then once a
    minute)."""
    refused, logged_at = "", 0.0
    while not stop.wait(interval_s):
        try:
            register(coordinator, address, device, min(5.0, interval_s * 2), security, memory_bytes)
            refused = ""
        except StageUnavailableError as exc:
            logger.debug("heartbeat to %s failed: %s", coordinator, exc)
        except FailedPreconditionError as exc:
            if str(exc) != refused or time.monotonic() - logged_at > 60.0:
                logger.error("heartbeat to %s refused: %s", coordinator, exc)
                refused, logged_at = str(exc), time.monotonic()


def _drain(
    service: StageService,
    coordinator: str,
    security: Security,
    timeout_s: float,
) -> None:
    """Waits while the stage still holds a job and its coordinator can move the layers away."""
    deadline = time.monotonic() + timeout_s
    while service.holds_job and time.monotonic() < deadline:
        if check_health(coordinator, 1.0, security) != Health.SERVING:
            logger.warning("coordinator %s is gone; stopping without handing over", coordinator)
            return
        time.sleep(0.25)
    if service.holds_job:
        logger.warning("stopping while still holding a job after %.0f s", timeout_s)


def _same_threads(count: int) -> Callable[[], None]:
    """An initializer that gives a request thread the process's torch thread count.

    ``torch.set_num_threads`` sets OpenMP's thread count for the calling thread only; a new
    thread starts from OpenMP's default (every core), and a matrix product MKL runs there
    before torch sets it lazily uses a team of that size. Its extra thread then spins between
    parallel regions on a core the other stages need: a tiny model's steps ran 2.4x slower
    once RunStep moved to a second request thread (a checkpoint streaming on the first)."""

    def initialize() -> None:
        torch.set_num_threads(count)

    return initialize


def settle_garbage_collector() -> None:
    """Collects once and freezes what is alive, so that no later collection traverses it.

    [Note: stage garbage collection] A stage process holds about 180,000 container objects
    once torch, gRPC and the models are imported, all alive until it exits. A full collection
    traverses each of them: 76 ms alone, about 190 ms under the benchmark's load, and a stage
    with the default settings ran two in a run of ~600 tiny-model steps
    (``bench/paired_overhead.py`` with a ``gc.callbacks`` probe), each a stall of a step.
    ``gc.freeze()`` moves them into the permanent generation, which no collection visits; the
    stage then ran no full collection after this one. Raising the youngest generation's
    threshold (700 to 10,000) was measured too and left out: the young collections' total time
    stayed about the same (~90 ms per 600 steps), in 20x longer pauses. Layers built later are
    not frozen: a dropped job's cycles must stay collectable (``malloc.give_back``)."""
    gc.collect()
    gc.freeze()


def run_stage(
    options: StageOptions,
    *,
    coordinator: str,
    listen: str,
    advertise: str | None,
    register_timeout_s: float,
    stop: threading.Event,
    heartbeat_interval_s: float = 2.0,
    drain_timeout_s: float = 60.0,
) -> None:
    """Serves a stage until ``stop`` is set, then stops gracefully.

    [Note: graceful stop] On stop the stage turns NOT_SERVING; its coordinator notices at the
    next step boundary (or within a second when idle), checkpoints and moves the layers to
    other stages, then releases this one, which exits. A stop never costs a recovery.

    Raises:
        PipesvcError: binding or registering failed.
    """
    host, _ = split_address(listen)
    if options.device.type == "cuda":
        torch.cuda.set_device(options.device)
    service = StageService(options)
    server, port, health = create_server(
        listen,
        [lambda s: add_stage_service(service, s, serve_control=options.serve_control)],
        security=options.security,
        limits=options.limits,
        thread_initializer=_same_threads(torch.get_num_threads()),
    )
    settle_garbage_collector()
    address = advertise or f"{host}:{port}"
    service.advertise(address, split_address(coordinator)[0])
    logger.info(
        "stage listening on %s:%d, advertised as %s, device %s",
        host,
        port,
        address,
        options.device,
    )
    beat_stop = threading.Event()
    try:
        register(
            coordinator,
            address,
            options.device,
            register_timeout_s,
            options.security,
            options.memory_bytes,
        )
        logger.info("registered with coordinator %s", coordinator)
        threading.Thread(
            target=_heartbeat,
            args=(
                coordinator,
                address,
                options.device,
                options.security,
                heartbeat_interval_s,
                beat_stop,
                options.memory_bytes,
            ),
            name="heartbeat",
            daemon=True,
        ).start()
        stop.wait()
        logger.info("stopping: NOT_SERVING until the coordinator moves my layers away")
        health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        _drain(service, coordinator, options.security, drain_timeout_s)
    finally:
        beat_stop.set()
        health.enter_graceful_shutdown()
        # Bounded: grpc's stop can hang after a stream whose request failed to deserialize.
        server.stop(grace=2.0).wait(timeout=5.0)
        service.close()
