"""The one table from error classes to gRPC status codes, and both directions of the mapping.

Servers raise PipesvcError subclasses; ``handle_errors`` turns them into a status code plus the
class name in trailing metadata. Clients make their calls inside ``rpc_errors``, which raises the
same class with the server's message (``error_from_rpc``), so callers never see ``grpc.RpcError``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import grpc

from pipesvc import errors
from pipesvc.errors import PipesvcError

logger = logging.getLogger(__name__)

ERROR_CLASS_KEY = "pipesvc-error-class"
LOST_SESSIONS_KEY = "pipesvc-lost-sessions"
"""A ``SessionCacheLostError``'s sessions, comma-separated (the coordinator replays those)."""

STATUS_CODES: dict[type[PipesvcError], grpc.StatusCode] = {
    errors.PipesvcError: grpc.StatusCode.INTERNAL,
    errors.InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownModelError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.WireFormatError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PlanError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SessionCacheLostError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.StageOutOfMemoryError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.KVBudgetError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.StageUnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.WrongServiceError: grpc.StatusCode.UNIMPLEMENTED,  # raised by clients (diagnose.py)
    errors.UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    errors.PipelineTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.StepAbortedError: grpc.StatusCode.ABORTED,
    errors.InternalError: grpc.StatusCode.INTERNAL,
}

# For errors from a server that sent no class name (another implementation, or gRPC itself).
_CLASS_FOR_CODE: dict[grpc.StatusCode, type[PipesvcError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: errors.StageUnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: errors.UnauthenticatedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.PipelineTimeoutError,
    grpc.StatusCode.ABORTED: errors.StepAbortedError,
    grpc.StatusCode.CANCELLED: errors.StepAbortedError,
}
_CLASS_BY_NAME: dict[str, type[PipesvcError]] = {cls.__name__: cls for cls in STATUS_CODES}


def status_code(error: PipesvcError) -> grpc.StatusCode:
    """The status code of ``error``'s class (its nearest listed ancestor)."""
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


def error_from_rpc(error: grpc.RpcError, where: str = "") -> PipesvcError:
    """The PipesvcError a failed call stands for, with the server's message.

    ``where`` (e.g. ``"stage 127.0.0.1:5001"``) prefixes the message of transport failures.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    # grpc's entries are (key, value) named tuples; the stubs call them a non-iterable class.
    return error_from_status(
        code, details, cast("Iterable[tuple[str, str | bytes]]", trailing or ()), where
    )


def error_from_status(
    code: grpc.StatusCode,
    details: str,
    trailing: Iterable[tuple[str, str | bytes]],
    where: str = "",
) -> PipesvcError:
    """The PipesvcError of a call that ended with status ``code``, message ``details`` and
    ``trailing`` metadata: a failed call's, or one a control stream carried back (see [Note:
    control stream] in pipesvc/coordinator/control_stream.py)."""
    name, lost = "", ""
    for key, value in trailing:
        if key == ERROR_CLASS_KEY:
            name = str(value)
        elif key == LOST_SESSIONS_KEY:
            lost = str(value)
    cls = _CLASS_BY_NAME.get(name) or _CLASS_FOR_CODE.get(code, errors.InternalError)
    if not name and where:
        details = f"{where}: {details}"
    if issubclass(cls, errors.SessionCacheLostError):
        return cls(details, [s for s in lost.split(",") if s])
    return cls(details)


def error_metadata(error: PipesvcError) -> list[tuple[str, str]]:
    """The trailing metadata a call that fails with ``error`` carries: its class name, and a
    ``SessionCacheLostError``'s sessions."""
    metadata = [(ERROR_CLASS_KEY, type(error).__name__)]
    if isinstance(error, errors.SessionCacheLostError) and error.sessions:
        metadata.append((LOST_SESSIONS_KEY, ",".join(error.sessions)))
    return metadata


@contextlib.contextmanager
def rpc_errors(
    where: str = "", *, convert: Callable[[grpc.RpcError], PipesvcError] | None = None
) -> Iterator[None]:
    """Inside, a failed call raises the PipesvcError it stands for, chained to the RpcError.

    The one place client code turns ``grpc.RpcError`` into the typed error tree: by default
    with ``error_from_rpc(exc, where)``; ``convert`` replaces that for a site whose failures all
    mean one thing (e.g. "could not register"). Other exceptions pass through untouched.

    Raises:
        PipesvcError: a call inside failed.
    """
    try:
        yield
    except grpc.RpcError as exc:
        raise (convert(exc) if convert is not None else error_from_rpc(exc, where)) from exc


_F = TypeVar("_F", bound=Callable[..., Any])


def abort_with(context: grpc.ServicerContext, error: PipesvcError) -> None:
    """Ends the call with ``error``'s status code, message and class name (raises)."""
    _abort(context, error)


def _abort(context: grpc.ServicerContext, error: PipesvcError) -> None:
    context.set_trailing_metadata(tuple(error_metadata(error)))
    context.abort(status_code(error), str(error))


def to_pipesvc(exc: Exception, method: str) -> PipesvcError:
    """``exc`` as a typed error: itself, or an InternalError naming ``method`` (logged)."""
    return _to_pipesvc(exc, method)


def _to_pipesvc(exc: Exception, method: str) -> PipesvcError:
    if isinstance(exc, PipesvcError):
        return exc
    logger.exception("unexpected error in %s", method)
    return errors.InternalError(f"{method} failed: {type(exc).__name__}: {exc}")


def handle_errors(method: _F) -> _F:
    """Wraps a servicer method so that every error leaves as a typed status, never UNKNOWN."""
    name = method.__name__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except Exception as exc:
                if not context.is_active():
                    return
                _abort(context, _to_pipesvc(exc, name))

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            _abort(context, _to_pipesvc(exc, name))

    return wrapper  # type: ignore[return-value]
