"""How a coordinator server runs: its options, from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipesvc.coordinator.stage_calls import Deadlines
from pipesvc.core.limits import Limits
from pipesvc.core.option_flags import flag
from pipesvc.observe.metrics import Metrics
from pipesvc.wire.security import Security

DEFAULT_COORDINATOR = "127.0.0.1:7070"
"""Where a coordinator listens, and where the CLI's commands look for one, by default."""
FORGET_STAGES_AFTER_S = 600.0
"""Default of ``--forget-stages-after-s``: a stage heartbeats every 2 s, so one unseen for ten
minutes is gone (a restarted stage on a new port is a new address)."""


@dataclass(frozen=True, kw_only=True)
class CoordinatorOptions:
    """How a coordinator server runs; its flags are generated from the fields marked ``flag``
    (see [Note: flags from options] in ``pipesvc.core.option_flags``)."""

    listen: str = field(default=DEFAULT_COORDINATOR, metadata=flag())
    """HOST:PORT the gRPC server binds (HOST:0 for any free port)."""
    state_dir: Path = field(default=Path("pipesvc-state"), metadata=flag(parse=Path))
    """Directory of the jobs' database, step logs and checkpoints (created if missing)."""
    address_file: Path | None = field(default=None, metadata=flag(parse=Path))
    """Write the bound HOST:PORT here once serving (so a parent that asked for port 0 learns
    the real one)."""
    http_port: int | None = field(default=None, metadata=flag(parse=int))
    """Serve the live page (stages, plans, step times, the last step's timeline) and the
    OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) on this port, on
    the --listen host (0: any free port; none by default)."""
    store_host: str = field(default="", metadata=flag())
    """Host the stages of a job with replicas dial for the key-value store where they form
    their gradient groups (empty: the host of the coordinator address each stage registered
    with)."""
    store_port: int = field(default=0, metadata=flag())
    """Port of that store (0: any free port, opened when the first such job starts)."""
    forget_stages_after_s: float = field(default=FORGET_STAGES_AFTER_S, metadata=flag())
    """Forget a stage that has not registered (heartbeat) for this long, unless a job uses it;
    a stage that comes back registers anew (see [Note: forgetting stages])."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    """Deadlines of the calls to the stages, and how a lost stage is detected."""
    security: Security = field(default_factory=Security)
    """Token and TLS of the server and of the channels it opens."""
    limits: Limits = field(default_factory=Limits)
    """Limits on everything received."""
    metrics: Metrics = field(default_factory=Metrics)
    """Where the coordinator records its metrics (nothing by default)."""
