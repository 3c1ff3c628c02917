"""How a stage server runs: its options, set once from the command line (no gRPC here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipesvc.core.limits import Limits
from pipesvc.observe.metrics import Metrics
from pipesvc.stage.compute.faults import FaultKill
from pipesvc.stage.dataplane.shm import DEFAULT_AREA_BYTES
from pipesvc.wire.security import Security


@dataclass(kw_only=True)
class StageOptions:
    """How a stage server runs; set once from the command line."""

    address: str
    """host:port that neighbours and the coordinator dial."""
    coordinator_host: str = ""
    """Host of the coordinator this stage registered with: where a gradient group of a job
    with replicas meets, unless the coordinator names another host."""
    device: torch.device
    """Where layers live and compute runs."""
    memory_bytes: int
    """Memory of that device, reported to the coordinator."""
    recv_timeout_s: float = 300.0
    """Longest wait for one activation or gradient before the run fails."""
    limits: Limits = field(default_factory=Limits)
    """Limits on everything received (tensors here; messages and calls in the server)."""
    shm_bytes: int = DEFAULT_AREA_BYTES
    """Size of the shared-memory area offered to a neighbour on the same host (0: never)."""
    security: Security = field(default_factory=Security)
    """Token and TLS for the channels this stage opens to its neighbour."""
    duplicate_sends: bool = False
    """Fault injection for tests: send every activation and gradient twice."""
    serve_control: bool = True
    """False for version-skew tests: serve no Control stream, as a stage built before it (the
    coordinator falls back to unary calls)."""
    fault_kill: FaultKill | None = None
    """Fault injection for tests: SIGKILL this stage at a chosen point."""
    metrics: Metrics = field(default_factory=Metrics)
    """Where the stage records its metrics (nothing by default)."""
    kv_budget_bytes: int = 1 << 30
    """Most bytes the generation sessions' key/value caches may hold on this stage."""
    session_idle_s: float = 300.0
    """A generation session idle this long is dropped from the stage."""
