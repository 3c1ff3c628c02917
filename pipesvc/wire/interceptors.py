"""Server and client interceptors: token auth, concurrency limits and the caller's protocol.

Health (grpc.health.v1) is exempt from all three, so a busy or locked-down server still answers
its health checks; a stage's registration is exempt from the protocol check, which it makes
itself (see [Note: wire protocol]).
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc

from pipesvc.wire.protocol import caller_refusal, names_another
from pipesvc.wire.rpc_status import ERROR_CLASS_KEY
from pipesvc.wire.security import AUTH_METADATA_KEY

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _replace_behavior(
    handler: grpc.RpcMethodHandler[Any, Any],
    wrap: Callable[[Callable[..., Any], bool], Callable[..., Any]],
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler like ``handler`` whose behavior is ``wrap(behavior, response_streaming)``."""
    if handler.request_streaming and handler.response_streaming:
        make, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    elif handler.request_streaming:
        make, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    elif handler.response_streaming:
        make, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    else:
        make, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
    assert behavior is not None, "a handler has the behavior its streaming flags name"
    return make(
        wrap(behavior, handler.response_streaming),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, error: str, message: str) -> None:
    context.set_trailing_metadata(((ERROR_CLASS_KEY, error),))
    context.abort(code, message)


def _header(details: grpc.HandlerCallDetails, key: str) -> str:
    """The value of metadata ``key`` the call carried, as text ("" without one)."""
    found = ""
    for name, value in details.invocation_metadata or ():
        if name == key:
            found = value if isinstance(value, str) else bytes(value).decode("utf-8", "replace")
    return found


def _refused(
    handler: grpc.RpcMethodHandler[Any, Any],
    code: grpc.StatusCode,
    error: str,
    message: Callable[[grpc.ServicerContext], str],
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with a behavior that only refuses the call (``message`` says why)."""

    def deny(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            _abort(context, code, error, message(context))

        return refuse

    return _replace_behavior(handler, deny)


class _ServerCheck(grpc.ServerInterceptor):
    """An interceptor that sees every call but health's (``_wrap``: the handler to use)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        return self._wrap(handler, details)

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        raise NotImplementedError


class AuthInterceptor(_ServerCheck):
    """Refuses every RPC but health unless it carries the shared token (constant-time check)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        presented = _header(details, AUTH_METADATA_KEY).encode()
        if hmac.compare_digest(presented, self._expected):
            return handler
        reason = "a wrong token" if presented else "no token"
        return _refused(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            "UnauthenticatedError",
            lambda _: f"{details.method} refused: the call carried {reason}",
        )


REGISTER_STAGE = "/pipesvc.v1.CoordinatorService/RegisterStage"
"""Checked by the registration itself, which tells the stage to exit and remembers the refusal
(see [Note: wire protocol])."""


class ProtocolInterceptor(_ServerCheck):
    """Refuses a call whose user agent names a pipesvc of another wire protocol (see [Note:
    wire protocol]); a caller that names none is let through."""

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        agent = _header(details, "user-agent")
        if details.method == REGISTER_STAGE or not names_another(agent):
            return handler
        return _refused(
            handler,
            grpc.StatusCode.FAILED_PRECONDITION,
            "FailedPreconditionError",
            lambda context: f"{details.method} refused: {caller_refusal(context.peer(), agent)}",
        )


class ConcurrencyInterceptor(_ServerCheck):
    """Caps unary and streaming calls in flight; a call over a cap gets RESOURCE_EXHAUSTED."""

    def __init__(self, max_rpcs: int, max_streams: int) -> None:
        self._rpcs = threading.BoundedSemaphore(max_rpcs)
        self._streams = threading.BoundedSemaphore(max_streams)
        self._limits = (max_rpcs, max_streams)

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        is_stream = handler.request_streaming or handler.response_streaming
        semaphore = self._streams if is_stream else self._rpcs
        limit = self._limits[1] if is_stream else self._limits[0]
        what = "streaming calls" if is_stream else "calls"

        def refuse(context: grpc.ServicerContext) -> None:
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "ResourceExhaustedError",
                f"{details.method} refused: {limit} {what} are already in flight (the limit)",
            )

        def limit_calls(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            if streaming:

                def run_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                    if not semaphore.acquire(blocking=False):
                        refuse(context)
                    try:
                        yield from behavior(request, context)
                    finally:
                        semaphore.release()

                return run_stream

            def run(request: Any, context: grpc.ServicerContext) -> Any:
                if not semaphore.acquire(blocking=False):
                    refuse(context)
                try:
                    return behavior(request, context)
                finally:
                    semaphore.release()

            return run

        return _replace_behavior(handler, limit_calls)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the shared token to every outgoing call, streams included."""

    def __init__(self, token: str) -> None:
        self._entry = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _details(self, details: Any) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._entry]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
