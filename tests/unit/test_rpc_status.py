"""Unit tests for pipesvc.wire.rpc_status: the class <-> status-code table in both directions."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pipesvc import errors
from pipesvc.errors import ALL_ERRORS, PipesvcError
from pipesvc.wire.rpc_status import (
    ERROR_CLASS_KEY,
    STATUS_CODES,
    error_from_rpc,
    handle_errors,
    rpc_errors,
    status_code,
)

Metadata = tuple[tuple[str, str], ...]


class FakeRpcError(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    """What a failed call raises on a client: a status code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        return self._trailing


class AbortedRpc(Exception):
    """Raised by FakeContext.abort, as grpc's ServicerContext.abort raises to end the handler."""


class FakeContext:
    """Records what a servicer method tells its context."""

    def __init__(self, active: bool = True) -> None:
        self.trailing: Metadata = ()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.active = active

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self.trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise AbortedRpc(details)

    def is_active(self) -> bool:
        return self.active

    def as_rpc_error(self) -> FakeRpcError:
        """The error a client of this call would see."""
        assert self.code is not None
        return FakeRpcError(self.code, self.details, self.trailing)


class Servicer:
    """A servicer whose methods raise whatever the request is."""

    @handle_errors
    def Unary(self, request: Any, context: Any) -> Any:
        if isinstance(request, BaseException):
            raise request
        return ("reply", request)

    @handle_errors
    def Stream(self, request: Any, context: Any) -> Iterator[Any]:
        yield 1
        yield 2
        if isinstance(request, BaseException):
            raise request
        yield 3


def test_every_error_class_has_a_status_code() -> None:
    assert set(ALL_ERRORS) == set(STATUS_CODES)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_no_error_class_maps_to_unknown_or_ok(cls: type[PipesvcError]) -> None:
    assert STATUS_CODES[cls] not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK)
    assert status_code(cls("x")) == STATUS_CODES[cls]


def test_unlisted_subclass_takes_its_nearest_ancestors_code() -> None:
    class Oddity(errors.PlanError):
        pass

    assert status_code(Oddity("x")) == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_class_name_in_metadata_maps_back_to_that_class(cls: type[PipesvcError]) -> None:
    rpc_error = FakeRpcError(
        STATUS_CODES[cls], "stage 3 says no", ((ERROR_CLASS_KEY, cls.__name__),)
    )
    error = error_from_rpc(rpc_error, where="stage 127.0.0.1:1")
    assert type(error) is cls
    assert str(error) == "stage 3 says no"


CODE_CLASSES = [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError),
    (grpc.StatusCode.NOT_FOUND, errors.NotFoundError),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPreconditionError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
    (grpc.StatusCode.UNAVAILABLE, errors.StageUnavailableError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.PipelineTimeoutError),
    (grpc.StatusCode.ABORTED, errors.StepAbortedError),
    (grpc.StatusCode.CANCELLED, errors.StepAbortedError),
    (grpc.StatusCode.INTERNAL, errors.InternalError),
    (grpc.StatusCode.UNKNOWN, errors.InternalError),
    (grpc.StatusCode.UNIMPLEMENTED, errors.InternalError),
]
"""Each status code and the class it maps to when the server sent no class name."""


def _code_ids(value: object) -> str:
    return str(getattr(value, "name", getattr(value, "__name__", value)))


@pytest.mark.parametrize(("code", "cls"), CODE_CLASSES, ids=_code_ids)
def test_code_without_metadata_maps_to_its_class(
    code: grpc.StatusCode, cls: type[PipesvcError]
) -> None:
    error = error_from_rpc(FakeRpcError(code, "connection refused"), where="stage 10.0.0.1:5")
    assert type(error) is cls
    assert str(error) == "stage 10.0.0.1:5: connection refused"


def test_unknown_class_name_falls_back_to_the_code() -> None:
    rpc_error = FakeRpcError(grpc.StatusCode.NOT_FOUND, "gone", ((ERROR_CLASS_KEY, "KeyError"),))
    assert type(error_from_rpc(rpc_error)) is errors.NotFoundError


def test_empty_details_still_give_a_message() -> None:
    error = error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, ""))
    assert "UNAVAILABLE" in str(error)


def test_unary_method_returns_normally() -> None:
    context = FakeContext()
    assert Servicer().Unary(5, context) == ("reply", 5)
    assert context.code is None
    assert Servicer.Unary.__name__ == "Unary"


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_unary_pipesvc_error_leaves_with_its_code_and_class(cls: type[PipesvcError]) -> None:
    context = FakeContext()
    with pytest.raises(AbortedRpc):
        Servicer().Unary(cls("num_stages (5) exceeds num_layers (4)"), context)
    assert context.code == STATUS_CODES[cls]
    assert context.details == "num_stages (5) exceeds num_layers (4)"
    assert context.trailing == ((ERROR_CLASS_KEY, cls.__name__),)
    # What the client makes of it is the very same class and message.
    round_tripped = error_from_rpc(context.as_rpc_error())
    assert type(round_tripped) is cls
    assert str(round_tripped) == context.details


@pytest.mark.parametrize("exc", [KeyError("job-7"), ValueError("bad"), RuntimeError("boom")])
def test_unary_plain_exception_is_internal_never_unknown(
    exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    context = FakeContext()
    with (
        caplog.at_level(logging.ERROR, logger="pipesvc.wire.rpc_status"),
        pytest.raises(AbortedRpc),
    ):
        Servicer().Unary(exc, context)
    assert context.code == grpc.StatusCode.INTERNAL
    assert "Unary" in context.details
    assert type(exc).__name__ in context.details
    assert type(error_from_rpc(context.as_rpc_error())) is errors.InternalError
    # The traceback stays in the server log.
    assert any(record.exc_info for record in caplog.records)


def test_stream_method_yields_everything_when_it_succeeds() -> None:
    context = FakeContext()
    assert list(Servicer().Stream(None, context)) == [1, 2, 3]
    assert context.code is None


@pytest.mark.parametrize(
    "exc",
    [errors.NotFoundError("no job j1"), errors.StepAbortedError("run 3"), KeyError("j1")],
    ids=lambda e: type(e).__name__,
)
def test_stream_error_after_some_items_leaves_with_its_code(exc: Exception) -> None:
    context = FakeContext()
    received: list[Any] = []
    with pytest.raises(AbortedRpc):
        for item in Servicer().Stream(exc, context):
            received.append(item)
    assert received == [1, 2]
    expected = status_code(exc) if isinstance(exc, PipesvcError) else grpc.StatusCode.INTERNAL
    assert context.code == expected
    assert context.code != grpc.StatusCode.UNKNOWN
    round_tripped = error_from_rpc(context.as_rpc_error())
    assert type(round_tripped) is (
        type(exc) if isinstance(exc, PipesvcError) else errors.InternalError
    )


def test_stream_error_after_the_client_left_is_dropped() -> None:
    context = FakeContext(active=False)
    assert list(Servicer().Stream(errors.NotFoundError("gone"), context)) == [1, 2]
    assert context.code is None


@pytest.mark.parametrize(("code", "cls"), CODE_CLASSES, ids=_code_ids)
def test_rpc_errors_raises_the_typed_error_of_each_code(
    code: grpc.StatusCode, cls: type[PipesvcError]
) -> None:
    rpc_error = FakeRpcError(code, "connection refused")
    with pytest.raises(PipesvcError) as caught, rpc_errors("coordinator 10.0.0.1:5"):
        raise rpc_error
    assert type(caught.value) is cls
    assert str(caught.value) == "coordinator 10.0.0.1:5: connection refused"
    assert caught.value.__cause__ is rpc_error


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_rpc_errors_keeps_the_class_the_server_named(cls: type[PipesvcError]) -> None:
    rpc_error = FakeRpcError(STATUS_CODES[cls], "job j1: no", ((ERROR_CLASS_KEY, cls.__name__),))
    with pytest.raises(PipesvcError) as caught, rpc_errors("stage 127.0.0.1:1"):
        raise rpc_error
    assert type(caught.value) is cls
    assert str(caught.value) == "job j1: no"


def test_rpc_errors_convert_decides_the_error() -> None:
    def unavailable(exc: grpc.RpcError) -> PipesvcError:
        return errors.StageUnavailableError(f"could not register: {exc.details()}")

    rpc_error = FakeRpcError(grpc.StatusCode.NOT_FOUND, "refused")
    with pytest.raises(PipesvcError) as caught, rpc_errors("ignored", convert=unavailable):
        raise rpc_error
    assert type(caught.value) is errors.StageUnavailableError
    assert str(caught.value) == "could not register: refused"
    assert caught.value.__cause__ is rpc_error


@pytest.mark.parametrize(
    "exc",
    [KeyError("j1"), errors.NotFoundError("no job j1"), ValueError("bad")],
    ids=lambda e: type(e).__name__,
)
def test_rpc_errors_lets_other_exceptions_through_unchanged(exc: Exception) -> None:
    with pytest.raises(type(exc)) as caught, rpc_errors("coordinator 10.0.0.1:5"):
        raise exc
    assert caught.value is exc
    assert caught.value.__cause__ is None


def test_rpc_errors_returns_normally_without_an_error() -> None:
    with rpc_errors("coordinator 10.0.0.1:5"):
        result = 7
    assert result == 7


def test_a_lost_cache_names_its_sessions_on_the_wire() -> None:
    """The coordinator replays exactly the sessions a stage lost: they travel as a structured
    detail, not in the message's text."""
    context = FakeContext()
    with pytest.raises(AbortedRpc):
        Servicer().Unary(errors.SessionCacheLostError("gone", ["a1", "b2"]), context)
    round_tripped = error_from_rpc(context.as_rpc_error())
    assert type(round_tripped) is errors.SessionCacheLostError
    assert round_tripped.sessions == ("a1", "b2")
