"""gRPC plumbing shared by every server and client: options, channels, calls, health."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar, overload

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pipesvc.core.health import Health
from pipesvc.core.limits import Limits
from pipesvc.errors import InvalidArgumentError, StageUnavailableError
from pipesvc.wire.interceptors import AuthInterceptor, ConcurrencyInterceptor, TokenInterceptor
from pipesvc.wire.rpc_status import rpc_errors
from pipesvc.wire.security import Security

logger = logging.getLogger(__name__)

KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
"""Pings on idle connections, so a dead peer is noticed; servers allow them (below)."""


def _message_options(limits: Limits) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_receive_message_length", limits.max_message_bytes),
    ]


_T = TypeVar("_T")
_Req = TypeVar("_Req")
NO_SECURITY = Security()
DEFAULT_LIMITS = Limits()


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) to its parts.

    Raises:
        InvalidArgumentError: no port, or a port outside [0, 65535].
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise InvalidArgumentError(f"address {address!r} must look like HOST:PORT")
    if int(port_text) > 65535:
        raise InvalidArgumentError(f"address {address!r} must look like HOST:PORT")
    return host, int(port_text)


def create_server(
    address: str,
    servicers: list[Callable[[grpc.Server], None]],
    *,
    security: Security = NO_SECURITY,
    limits: Limits = DEFAULT_LIMITS,
    thread_initializer: Callable[[], None] | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started server bound to ``address`` (port 0 picks one), with grpc.health.v1.

    Auth and concurrency limits are interceptors that leave health alone; the thread pool has
    room beyond the limits so health always gets a thread; each of its threads first runs
    ``thread_initializer``. Returns the server, the bound port and the health servicer
    (initially SERVING).

    Raises:
        StageUnavailableError: the address could not be bound.
    """
    split_address(address)
    interceptors: list[grpc.ServerInterceptor] = []
    if security.token is not None:
        interceptors.append(AuthInterceptor(security.token))
    interceptors.append(
        ConcurrencyInterceptor(limits.max_concurrent_rpcs, limits.max_concurrent_streams)
    )
    workers = limits.max_concurrent_rpcs + limits.max_concurrent_streams + 8
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, initializer=thread_initializer),
        interceptors=interceptors,
        options=[
            *_message_options(limits),
            *KEEPALIVE_OPTIONS,
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.so_reuseport", 0),
        ],
    )
    for add in servicers:
        add(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if security.tls is not None:
            tls = security.tls
            if tls.cert is None or tls.key is None:
                raise InvalidArgumentError("a TLS server needs a certificate and a key")
            credentials = grpc.ssl_server_credentials(
                [(tls.key, tls.cert)],
                root_certificates=tls.ca,
                require_client_auth=tls.ca is not None,
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise StageUnavailableError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise StageUnavailableError(f"cannot listen on {address}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def open_channel(
    address: str, security: Security = NO_SECURITY, limits: Limits = DEFAULT_LIMITS
) -> grpc.Channel:
    """A channel to ``address`` with the limits, keepalive, TLS and token of ``security``."""
    options = [*_message_options(limits), *KEEPALIVE_OPTIONS]
    tls = security.tls
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
        )
        channel = grpc.secure_channel(address, credentials, options=options)
    if security.token is not None:
        channel = grpc.intercept_channel(channel, TokenInterceptor(security.token))
    return channel


@overload
def call(
    method: grpc.UnaryUnaryMultiCallable[_Req, _T], request: _Req, *, timeout_s: float, where: str
) -> _T: ...


@overload
def call(
    method: grpc.StreamUnaryMultiCallable[_Req, _T],
    request: Iterator[_Req],
    *,
    timeout_s: float,
    where: str,
) -> _T: ...


def call(method: Callable[..., Any], request: Any, *, timeout_s: float, where: str) -> Any:
    """Calls a unary (or request-streaming) method of a stub with a deadline, mapping errors.

    Raises:
        PipesvcError: the subclass the server raised, or StageUnavailableError and friends.
    """
    with rpc_errors(where):
        return method(request, timeout=timeout_s)


def health_status(channel: grpc.Channel, timeout_s: float) -> Health:
    """The health of the server behind ``channel`` (UNREACHABLE if the check failed)."""
    try:
        # types-grpcio-health-checking declares HealthStub without its methods.
        reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
    except grpc.RpcError:
        return Health.UNREACHABLE
    return Health.from_wire(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def check_health(address: str, timeout_s: float = 2.0, security: Security = NO_SECURITY) -> Health:
    """``health_status`` of the server at ``address``, on a channel of its own."""
    with open_channel(address, security) as channel:
        return health_status(channel, timeout_s)
