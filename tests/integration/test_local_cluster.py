"""LocalCluster starts real processes and leaves none behind, on exit or on error."""

from __future__ import annotations

import os

import pytest

import pipesvc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_no_process_survives_an_error_inside_the_block() -> None:
    pids: list[int] = []
    with (
        pytest.raises(RuntimeError, match="user code failed"),
        pipesvc.LocalCluster(num_stages=2, threads_per_stage=1) as cluster,
    ):
        pids = cluster.pids
        assert len(pids) == 3
        assert all(_alive(pid) for pid in pids)
        raise RuntimeError("user code failed")
    assert pids
    assert not any(_alive(pid) for pid in pids)


def _children() -> set[int]:
    """Pids of this process's live children (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(entry))
    return found


def test_a_stage_that_cannot_start_is_reported_and_cleaned_up() -> None:
    before = _children()
    cluster = pipesvc.LocalCluster(num_stages=2, models=["no_such_module_xyz"], threads_per_stage=1)
    with pytest.raises(pipesvc.StageUnavailableError, match="no_such_module_xyz"):
        cluster.start()
    assert _children() <= before
