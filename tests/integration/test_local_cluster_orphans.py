"""A LocalCluster's processes go when the process that owns it dies without closing it
(see [Note: owned processes] in ``pipesvc.owner``)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipesvc.owner import OWNER_PID_ENV, owner_environ

OWNER = """
import json, os, sys, threading, time
import pipesvc

clusters = []
def start():
    clusters.append(pipesvc.LocalCluster(num_stages=2, threads_per_stage=1).start())
if sys.argv[1] == "thread":
    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    time.sleep(1)
else:
    start()
cluster = clusters[0]
with cluster.connect(timeout_s=10) as client:
    health = [str(s.health) for s in client.stages()]
print(json.dumps({"pids": cluster.pids, "health": health}), flush=True)
time.sleep(600)
"""
"""A process that starts a cluster (on its main thread, or on a worker thread that has ended
by the time it reports), prints its pids and its stages' health, and never closes it."""

GONE_WITHIN_S = 20.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _describe(pid: int) -> str:
    """A live process's command line and where each of its threads waits, for a failure's
    message."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120]
        threads = []
        for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
            name = (task / "comm").read_text().strip()
            wchan = (task / "wchan").read_text().strip() if (task / "wchan").exists() else "?"
            threads.append(f"{name}:{wchan}")
    except OSError as exc:
        return f"{pid} ({exc})"
    return f"{pid} {command!r} threads [{', '.join(threads)}]"


def _start_owner(on: str) -> tuple[subprocess.Popen[str], dict[str, list[Any]]]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, on], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert owner.stdout is not None
    ready, _, _ = select.select([owner.stdout], [], [], 180)
    line = owner.stdout.readline() if ready else ""
    if not line:
        owner.kill()
        owner.wait()
        owner.stdout.close()
        pytest.fail("the owner process did not start its cluster")
    report: dict[str, list[Any]] = json.loads(line)
    return owner, report


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("signum", "on"),
    [(signal.SIGKILL, "main"), (signal.SIGTERM, "main"), (signal.SIGKILL, "thread")],
    ids=["SIGKILL", "SIGTERM", "SIGKILL-started-on-a-thread"],
)
def test_the_cluster_goes_when_its_owner_is_killed(signum: int, on: str) -> None:
    owner, report = _start_owner(on)
    pids = [int(pid) for pid in report["pids"]]
    try:
        assert len(pids) == 3
        assert all(_alive(pid) for pid in pids)
        # A cluster outlives the thread that started it: only the owner's death stops it.
        assert report["health"] == ["SERVING", "SERVING"]
        owner.send_signal(signum)
        assert owner.wait(timeout=30) == -signum
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [pid for pid in pids if _alive(pid)]
        described = "; ".join(_describe(pid) for pid in survivors)
        assert not survivors, f"still running {GONE_WITHIN_S} s after the owner died: {described}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_whose_owner_died_before_it_started_watching_exits_at_once(
    tmp_path: Path,
) -> None:
    # Its parent (this process) is not the owner it was given: the owner is gone already.
    env = owner_environ()
    env[OWNER_PID_ENV] = str(os.getppid())
    args = ["coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "pipesvc", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "the process that started it is gone" in done.stderr
