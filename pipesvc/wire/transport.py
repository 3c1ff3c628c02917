"""gRPC plumbing shared by every server and client: options, channels, calls, health."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar, cast, overload

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pipesvc.core.health import Health
from pipesvc.core.limits import Limits
from pipesvc.errors import InvalidArgumentError, StageUnavailableError
from pipesvc.wire.interceptors import (
    AuthInterceptor,
    ConcurrencyInterceptor,
    ProtocolInterceptor,
    TokenInterceptor,
)
from pipesvc.wire.protocol import user_agent
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
_M = TypeVar("_M", bound=Message)
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

    Auth, concurrency limits and the callers' protocol are interceptors that leave health
    alone; the thread pool has room beyond the limits so health always gets a thread; each of
    its threads first runs ``thread_initializer``. Returns the server, the bound port and the
    health servicer (initially SERVING).

    Raises:
        StageUnavailableError: the address could not be bound.
    """
    split_address(address)
    interceptors: list[grpc.ServerInterceptor] = []
    if security.token is not None:
        interceptors.append(AuthInterceptor(security.token))
    interceptors.append(ProtocolInterceptor())
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


@dataclass(frozen=True, slots=True)
class Codec:
    """How one method's messages are (de)serialized when not by protobuf alone (None: as
    generated)."""

    request_deserializer: Callable[[bytes], Any] | None = None
    response_serializer: Callable[[Any], bytes] | None = None


def add_service(
    add: Callable[[grpc.Server], None],
    server: grpc.Server,
    codecs: Mapping[str, Codec],
    *,
    without: Collection[str] = (),
) -> None:
    """Registers the service that ``add`` (a generated ``add_*Servicer_to_server`` bound to
    its servicer) registers, with the methods named in ``codecs`` using those (de)serializers:
    [Note: frame wire] for Exchange, [Note: payload wire] for the requests that carry a batch.
    The methods named in ``without`` are left out (a peer calling one gets UNIMPLEMENTED, as
    from a server built before it existed).

    Raises:
        ValueError: ``codecs`` or ``without`` names a method the service does not have.
    """

    class _Capture:
        def __init__(self) -> None:
            self.service = ""
            self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

        def add_generic_rpc_handlers(self, handlers: object) -> None:
            pass

        def add_registered_method_handlers(
            self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
        ) -> None:
            self.service, self.handlers = service, dict(handlers)

    capture = _Capture()
    # The generated function only calls the two registration methods _Capture has.
    add(cast(grpc.Server, capture))
    handlers = capture.handlers
    for name, codec in codecs.items():
        if name not in handlers:
            raise ValueError(f"service {capture.service} has no method {name!r}")
        handlers[name] = _with_codec(handlers[name], codec)
    for name in without:
        if handlers.pop(name, None) is None:
            raise ValueError(f"service {capture.service} has no method {name!r}")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(capture.service, handlers),)
    )
    server.add_registered_method_handlers(capture.service, handlers)


def _with_codec(
    handler: grpc.RpcMethodHandler[Any, Any], codec: Codec
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with ``codec``'s (de)serializers in place of the generated ones."""
    kw = {
        "request_deserializer": codec.request_deserializer or handler.request_deserializer,
        "response_serializer": codec.response_serializer or handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(handler.stream_stream, **kw)  # type: ignore[arg-type]
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(handler.stream_unary, **kw)  # type: ignore[arg-type]
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(handler.unary_stream, **kw)  # type: ignore[arg-type]
    return grpc.unary_unary_rpc_method_handler(handler.unary_unary, **kw)  # type: ignore[arg-type]


def unary_method(
    channel: grpc.Channel,
    method: MethodDescriptor,
    request_serializer: Callable[[_Req], bytes],
    response_class: type[_M],
) -> grpc.UnaryUnaryMultiCallable[_Req, _M]:
    """A unary method of ``channel`` whose requests ``request_serializer`` encodes (see [Note:
    payload wire]); named by its descriptor (``coordinator_pb2.DESCRIPTOR.services_by_name
    [...].methods_by_name[...]``), so a renamed method fails at import, not on the wire."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    return channel.unary_unary(
        path,
        request_serializer=request_serializer,
        response_deserializer=response_class.FromString,
    )


def stream_method(
    channel: grpc.Channel,
    method: MethodDescriptor,
    request_serializer: Callable[[_Req], bytes],
    response_class: type[_M],
) -> grpc.StreamStreamMultiCallable[_Req, _M]:
    """A bidirectional streaming method of ``channel`` whose requests ``request_serializer``
    encodes, named by its descriptor as for ``unary_method``."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    return channel.stream_stream(
        path,
        request_serializer=request_serializer,
        response_deserializer=response_class.FromString,
    )


def open_channel(
    address: str, security: Security = NO_SECURITY, limits: Limits = DEFAULT_LIMITS
) -> grpc.Channel:
    """A channel to ``address`` with the limits, keepalive, TLS and token of ``security``."""
    options = [
        *_message_options(limits),
        *KEEPALIVE_OPTIONS,
        ("grpc.primary_user_agent", user_agent()),  # see [Note: wire protocol]
    ]
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
    return health_check(channel, timeout_s)[0]


def health_check(channel: grpc.Channel, timeout_s: float) -> tuple[Health, bool]:
    """``health_status``, and whether a failed check found the server gone: the connection was
    refused or closed (UNAVAILABLE: no process listens at the address any more, or it shut
    down), rather than left unanswered for ``timeout_s`` (a server stopped, hung or cut off,
    which may answer again)."""
    try:
        # types-grpcio-health-checking declares HealthStub without its methods.
        reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
    except grpc.RpcError as exc:
        return Health.UNREACHABLE, exc.code() == grpc.StatusCode.UNAVAILABLE
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return Health.from_wire(status), False


def check_health(address: str, timeout_s: float = 2.0, security: Security = NO_SECURITY) -> Health:
    """``health_status`` of the server at ``address``, on a channel of its own."""
    with open_channel(address, security) as channel:
        return health_status(channel, timeout_s)
