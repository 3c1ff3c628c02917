"""Caps a process's CPU with the cgroup v1 cpu controller, to make one stage slow."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000


@contextlib.contextmanager
def cpu_capped(pid: int, share: float) -> Iterator[Path]:
    """Runs process ``pid`` (all its threads) at most ``share`` of one CPU until the block
    ends, in a cgroup of its own that is removed afterwards.

    The quota is enforced per 10 ms period rather than the kernel's default 100 ms: a stage
    whose work per step is a few milliseconds would otherwise run at full speed until the
    quota ran out and then stall for the rest of the period, so which call paid for the
    stall (and how slow the stage measured) depended on chance."""
    group = CPU_ROOT / f"pipesvc-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        period = PERIOD_US
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(int(period * share)))
        (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        with contextlib.suppress(OSError):  # the process may have exited
            for task in (group / "cgroup.procs").read_text().split():
                (CPU_ROOT / "cgroup.procs").write_text(task)
        os.rmdir(group)
