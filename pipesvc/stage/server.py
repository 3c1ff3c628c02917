"""Running a stage server: bind, register with the coordinator, serve until stopped."""

from __future__ import annotations

import logging
import os
import threading

import grpc
import torch

from pipesvc import models
from pipesvc.errors import StageUnavailableError
from pipesvc.limits import Limits
from pipesvc.security import Security
from pipesvc.stage.service import StageOptions, StageService
from pipesvc.transport import create_server, open_channel, split_address
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2_grpc

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    """CUDA when one is available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` (physical RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def register(
    coordinator: str,
    address: str,
    device: torch.device,
    timeout_s: float,
    security: Security,
) -> None:
    """Announces this stage to the coordinator, waiting up to ``timeout_s`` for it to be up.

    Raises:
        StageUnavailableError: the coordinator did not answer in time.
    """
    request = coordinator_pb2.RegisterStageRequest(
        address=address,
        device=str(device),
        memory_bytes=device_memory_bytes(device),
        models=models.known_models(),
    )
    with open_channel(coordinator, security) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        try:
            stub.RegisterStage(request, timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise StageUnavailableError(
                f"could not register with the coordinator at {coordinator}: {exc.details()}"
            ) from exc


def run_stage(
    *,
    coordinator: str,
    listen: str,
    advertise: str | None,
    device: torch.device,
    recv_timeout_s: float,
    register_timeout_s: float,
    stop: threading.Event,
    security: Security | None = None,
    limits: Limits | None = None,
    duplicate_sends: bool = False,
) -> None:
    """Serves a stage until ``stop`` is set, then shuts down gracefully.

    Raises:
        PipesvcError: binding or registering failed.
    """
    host, _ = split_address(listen)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options = StageOptions(
        address="",
        device=device,
        memory_bytes=device_memory_bytes(device),
        recv_timeout_s=recv_timeout_s,
        security=security or Security(),
        limits=limits or Limits(),
        duplicate_sends=duplicate_sends,
    )
    service = StageService(options)
    server, port, health = create_server(
        listen,
        [lambda s: stage_pb2_grpc.add_StageServiceServicer_to_server(service, s)],
        security=options.security,
        limits=options.limits,
    )
    address = advertise or f"{host}:{port}"
    options.address = address
    logger.info(
        "stage listening on %s:%d, advertised as %s, device %s", host, port, address, device
    )
    try:
        register(coordinator, address, device, register_timeout_s, options.security)
        logger.info("registered with coordinator %s", coordinator)
        stop.wait()
    finally:
        health.enter_graceful_shutdown()
        server.stop(grace=2.0).wait()
