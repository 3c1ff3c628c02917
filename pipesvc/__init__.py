"""pipesvc: train and serve a sequential PyTorch model split over gRPC stage servers.

See README.md for the tour; the public API is listed in ``__all__``.
"""

from pipesvc import models
from pipesvc.client import Client, Job, StageStatus, connect
from pipesvc.core.config import JobConfig
from pipesvc.core.plan import PipelineStage
from pipesvc.core.version import VERSION
from pipesvc.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KVBudgetError,
    NotFoundError,
    PipelineTimeoutError,
    PipesvcError,
    PlanError,
    ResourceExhaustedError,
    StageOutOfMemoryError,
    StageUnavailableError,
    StepAbortedError,
    UnauthenticatedError,
    UnknownModelError,
    WireFormatError,
    WrongServiceError,
)
from pipesvc.local_cluster import LocalCluster
from pipesvc.models import LayerSpec, register_model
from pipesvc.models.hf import register_hf_model
from pipesvc.storage.weights import WeightLimits, load_weights, save_weights
from pipesvc.wire.security import TLSConfig

__version__ = VERSION

__all__ = [
    "Client",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "Job",
    "JobConfig",
    "KVBudgetError",
    "LayerSpec",
    "LocalCluster",
    "NotFoundError",
    "PipelineStage",
    "PipelineTimeoutError",
    "PipesvcError",
    "PlanError",
    "ResourceExhaustedError",
    "StageOutOfMemoryError",
    "StageStatus",
    "StageUnavailableError",
    "StepAbortedError",
    "TLSConfig",
    "UnauthenticatedError",
    "UnknownModelError",
    "WeightLimits",
    "WireFormatError",
    "WrongServiceError",
    "__version__",
    "connect",
    "load_weights",
    "models",
    "register_hf_model",
    "register_model",
    "save_weights",
]
