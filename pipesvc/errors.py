"""The pipesvc exception tree; every error a caller can see is one of these.

::

    PipesvcError
    +-- InvalidArgumentError (ValueError)      a request or option is malformed
    |   +-- UnknownModelError                  the model name is not registered
    |   +-- WireFormatError                    a tensor or frame on the wire is malformed
    +-- NotFoundError (LookupError)            the job or stage does not exist
    +-- FailedPreconditionError                valid request, wrong state (busy stage, closed job)
    |   +-- PlanError                          no plan fits (too many stages, too few servers)
    |   +-- SessionCacheLostError              a stage holds no cache of a session a run names
    +-- ResourceExhaustedError                 a size or count limit was exceeded
    |   +-- StageOutOfMemoryError              a stage's device ran out of memory in a run
    |   +-- KVBudgetError                      a stage's key/value caches would pass --kv-budget
    +-- StageUnavailableError                  a server could not be reached
    |   +-- WrongServiceError                  it answers, but is not the kind asked for
    +-- UnauthenticatedError                   missing or wrong token or certificate
    +-- PipelineTimeoutError                   a step or call ran past its deadline
    +-- StepAbortedError                       the step was aborted; nothing was committed
    +-- InternalError                          a bug or an unexpected failure on a server

The mapping of each class to a gRPC status code lives in ``rpc_status.py`` (the edge); this
module stays free of gRPC so that pure code can raise these errors.
"""

from __future__ import annotations

from collections.abc import Iterable


class PipesvcError(Exception):
    """Base class of every pipesvc error."""


class InvalidArgumentError(PipesvcError, ValueError):
    """A request, option or tensor is malformed; nothing was changed."""


class UnknownModelError(InvalidArgumentError):
    """The requested model name is not registered on the server."""


class WireFormatError(InvalidArgumentError):
    """A tensor or frame that arrived over the network is malformed."""


class NotFoundError(PipesvcError, LookupError):
    """The named job or stage does not exist."""


class FailedPreconditionError(PipesvcError):
    """The request is well formed but the system is not in a state to run it."""


class PlanError(FailedPreconditionError):
    """No plan can place the model on the stages available."""


class SessionCacheLostError(FailedPreconditionError):
    """A generation run named caches a stage does not hold (expired, released or never
    started); ``sessions`` names their sessions, and the run changed nothing there."""

    def __init__(self, message: str, sessions: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.sessions: tuple[str, ...] = tuple(sessions)


class ResourceExhaustedError(PipesvcError):
    """A size, count or memory limit was exceeded."""


class StageOutOfMemoryError(ResourceExhaustedError):
    """A stage ran out of memory computing a run (not the caller's input being malformed); the
    run was aborted everywhere and nothing changed, so the same call fails the same way."""


class KVBudgetError(ResourceExhaustedError):
    """A generation run would take a stage's key/value caches past its ``--kv-budget``; the
    run changed nothing there. The message has the sizes."""


class StageUnavailableError(PipesvcError):
    """A stage or coordinator could not be reached."""


class WrongServiceError(StageUnavailableError):
    """The address answers, but with another service (e.g. a stage where a coordinator was
    expected), so the one asked for could not be reached there."""


class UnauthenticatedError(PipesvcError):
    """The caller did not prove who it is (missing or wrong token, or no client certificate)."""


class PipelineTimeoutError(PipesvcError):
    """A call or pipeline step ran past its deadline."""


class StepAbortedError(PipesvcError):
    """The step was aborted on every stage; no weights changed."""


class InternalError(PipesvcError):
    """An unexpected failure on a server; its log has the traceback."""


ALL_ERRORS: tuple[type[PipesvcError], ...] = (
    PipesvcError,
    InvalidArgumentError,
    UnknownModelError,
    WireFormatError,
    NotFoundError,
    FailedPreconditionError,
    PlanError,
    SessionCacheLostError,
    ResourceExhaustedError,
    StageOutOfMemoryError,
    KVBudgetError,
    StageUnavailableError,
    WrongServiceError,
    UnauthenticatedError,
    PipelineTimeoutError,
    StepAbortedError,
    InternalError,
)
"""Every error class, for the status-code table and its completeness test."""
