"""How a stage server runs: its options, set once from the command line (no gRPC here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipesvc.core.limits import Limits, parse_bytes
from pipesvc.core.option_flags import bytes_text, flag
from pipesvc.observe.metrics import Metrics
from pipesvc.stage.compute.faults import FaultKill
from pipesvc.stage.dataplane.shm import DEFAULT_AREA_BYTES
from pipesvc.wire.security import Security


def parse_size_or_zero(text: str) -> int:
    """A byte size as ``parse_bytes`` takes it, or ``0`` (off).

    Raises:
        InvalidArgumentError: neither.
    """
    return 0 if text.strip() == "0" else parse_bytes(text)


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """How a stage server runs, from the command line (its flags are generated from the fields
    marked ``flag``: see [Note: flags from options] in ``pipesvc.core.option_flags``). The address
    and the coordinator's host are known once the server is bound (``StageService.advertise``)."""

    address: str
    """host:port that neighbours and the coordinator dial."""
    coordinator_host: str = ""
    """Host of the coordinator this stage registered with: where a gradient group of a job
    with replicas meets, unless the coordinator names another host."""
    device: torch.device
    """Where layers live and compute runs."""
    memory_bytes: int
    """Memory of that device, reported to the coordinator."""
    recv_timeout_s: float = field(default=300.0, metadata=flag())
    """Longest wait for one activation or gradient before the run fails."""
    limits: Limits = field(default_factory=Limits)
    """Limits on everything received (tensors here; messages and calls in the server)."""
    shm_bytes: int = field(
        default=DEFAULT_AREA_BYTES, metadata=flag(parse=parse_size_or_zero, show=bytes_text)
    )
    """Shared-memory area offered to a neighbour on the same host; 0 turns the shared-memory
    path off both ways: no area offered, none of a neighbour's mapped."""
    security: Security = field(default_factory=Security)
    """Token and TLS for the channels this stage opens to its neighbour."""
    duplicate_sends: bool = field(default=False, metadata=flag(hidden=True))
    """Fault injection for tests: send every activation and gradient twice."""
    serve_control: bool = True
    """False for version-skew tests: serve no Control stream, as a stage built before it (the
    coordinator falls back to unary calls)."""
    fault_kill: FaultKill | None = None
    """Fault injection for tests: SIGKILL this stage at a chosen point."""
    metrics: Metrics = field(default_factory=Metrics)
    """Where the stage records its metrics (nothing by default)."""
    kv_budget_bytes: int = field(
        default=1 << 30, metadata=flag("--kv-budget", parse=parse_bytes, show=bytes_text)
    )
    """Most bytes the generation sessions' key/value caches may hold on this stage."""
    session_idle_s: float = field(default=300.0, metadata=flag())
    """A generation session idle this long is dropped from the stage."""
    generate_threads: int = field(default=0, metadata=flag())
    """torch intra-op threads of a generation run (0: as many as any other run): its stages
    compute one after another, so each may use every core of its host."""
