"""gRPC plumbing shared by every server and client: options, channels, calls, health."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pipesvc.errors import InvalidArgumentError, StageUnavailableError
from pipesvc.rpc_status import error_from_rpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
"""Largest gRPC message a server or channel accepts (control messages carry whole batches)."""

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]

_T = TypeVar("_T")


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) to its parts.

    Raises:
        InvalidArgumentError: no port, or a port outside [0, 65535].
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise InvalidArgumentError(f"address {address!r} must look like HOST:PORT")
    return host, int(port_text)


def create_server(
    address: str, servicers: list[Callable[[grpc.Server], None]], max_workers: int = 64
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started server bound to ``address`` (port 0 picks one), with grpc.health.v1.

    Returns the server, the bound port and the health servicer (initially SERVING).

    Raises:
        StageUnavailableError: the address could not be bound.
    """
    split_address(address)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS
    )
    for add in servicers:
        add(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise StageUnavailableError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise StageUnavailableError(f"cannot listen on {address}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def open_channel(address: str) -> grpc.Channel:
    """A channel to ``address`` with pipesvc's message limits and keepalive."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def call(method: Callable[..., _T], request: Any, *, timeout_s: float, where: str) -> _T:
    """Calls a unary (or request-streaming) method with a deadline, mapping errors.

    Raises:
        PipesvcError: the subclass the server raised, or StageUnavailableError and friends.
    """
    try:
        return method(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, where) from exc


def check_health(address: str, timeout_s: float = 2.0) -> str:
    """``"SERVING"``, ``"NOT_SERVING"`` or ``"UNREACHABLE"`` for the server at ``address``."""
    with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
