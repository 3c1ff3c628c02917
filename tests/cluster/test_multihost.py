"""Several hosts on one machine: the coordinator and each stage in its own network namespace,
joined by veth pairs on a bridge, with private addresses this test creates and removes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PREFIX = f"psvc{os.getpid() % 10000}"
HUB = f"{PREFIX}-hub"
HOSTS = {
    "coord": "10.77.0.1",
    "s0": "10.77.0.10",
    "s1": "10.77.0.11",
    "s2": "10.77.0.12",
    "s3": "10.77.0.13",
}
TOKEN = "multi-host-test-token"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_available() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}-probe"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    names = {host: f"{PREFIX}-{host}" for host in HOSTS}
    created: list[str] = []
    try:
        _ip("netns", "add", HUB)
        created.append(HUB)
        _ip("-n", HUB, "link", "add", "br0", "type", "bridge")
        _ip("-n", HUB, "link", "set", "br0", "up")
        for host, address in HOSTS.items():
            ns = names[host]
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip(
                "link",
                "add",
                f"{PREFIX}{host}",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"h{PREFIX}{host}",
                "netns",
                HUB,
            )
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"{PREFIX}{host}")
            _ip("-n", ns, "link", "set", f"{PREFIX}{host}", "up")
            _ip("-n", HUB, "link", "set", f"h{PREFIX}{host}", "master", "br0")
            _ip("-n", HUB, "link", "set", f"h{PREFIX}{host}", "up")
        yield names
    finally:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _spawn(ns: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Runs pipesvc on a simulated host: its own network namespace, and its own /dev/shm
    (``ip netns exec`` gives the command a private mount namespace), so stages cannot share
    memory with each other and must fall back to frames on the stream."""
    own_shm = 'mount -t tmpfs -o size=64m pipesvc-host-shm /dev/shm && exec "$0" "$@"'
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "sh",
                "-c",
                own_shm,
                sys.executable,
                "-m",
                "pipesvc",
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def _registered(coord_ns: str, coordinator: str, count: int) -> list[str]:
    """Waits, from inside the coordinator's namespace, until ``count`` stages are registered
    and serving; returns their addresses in registration order."""
    result = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            coord_ns,
            sys.executable,
            "-m",
            "tests.support.multihost_scenario",
            "wait",
            coordinator,
            TOKEN,
            str(count),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    addresses: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return addresses


COORDINATOR = f"{HOSTS['coord']}:7070"


def _start(
    hosts: dict[str, str], tmp_path: Path, stage_hosts: tuple[str, ...]
) -> list[subprocess.Popen[bytes]]:
    """The coordinator, then each stage host's stage, each registered before the next starts
    (so they register in this order); returns the processes."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    auth = ["--token-file", str(token_file)]
    state = str(tmp_path / "state")
    procs = [
        _spawn(
            hosts["coord"],
            ["coordinator", "--listen", COORDINATOR, "--state-dir", state, *auth],
            tmp_path / "coord.log",
        )
    ]
    try:
        for count, host in enumerate(stage_hosts, start=1):
            address = f"{HOSTS[host]}:50051"
            args = ["stage", "--coordinator", COORDINATOR, "--listen", address, "--threads", "1"]
            procs.append(_spawn(hosts[host], [*args, *auth], tmp_path / f"{host}.log"))
            registered = _registered(hosts["coord"], COORDINATOR, count)
            assert registered[-1] == address, registered
    except BaseException:
        _stop(procs)
        raise
    return procs


def _scenario(hosts: dict[str, str], tmp_path: Path, *args: str) -> dict[str, Any]:
    """Runs ``tests.support.multihost_scenario`` with ``args`` in the coordinator's host;
    returns the JSON summary it prints."""
    result = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            hosts["coord"],
            sys.executable,
            "-m",
            "tests.support.multihost_scenario",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    logs = "\n".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("*.log")))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    summary: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return summary


def test_stage_host_link_down_mid_training(hosts: dict[str, str], tmp_path: Path) -> None:
    # s2 registers last: the spare; the job is created once all three are there.
    procs = _start(hosts, tmp_path, ("s0", "s1", "s2"))
    try:
        summary = _scenario(hosts, tmp_path, COORDINATOR, TOKEN, hosts["s1"], f"{PREFIX}s1")
        assert summary["plan_before"] == [f"{HOSTS['s0']}:50051", f"{HOSTS['s1']}:50051"]
        assert summary["plan_after"] == [f"{HOSTS['s0']}:50051", f"{HOSTS['s2']}:50051"]
        assert summary["recoveries"] == 1
        assert summary["shm"] == {a: [False, False] for a in summary["plan_after"]}
        print(f"\nmulti-host: link down detected and recovered in {summary['recovered_s']} s")
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_replicas_sum_their_gradients_across_hosts(hosts: dict[str, str], tmp_path: Path) -> None:
    """A 2 x 2 replicated job with every stage on its own host: each stage's gloo links bind
    its own address, and the gradient groups meet at the store on the coordinator's host (the
    host each stage registered with)."""
    stage_hosts = ("s0", "s1", "s2", "s3")
    procs = _start(hosts, tmp_path, stage_hosts)
    try:
        summary = _scenario(hosts, tmp_path, "replicas", COORDINATOR, TOKEN)
        assert summary["plan"] == [
            [r, k, f"{HOSTS[stage_hosts[2 * r + k]]}:50051"] for r in range(2) for k in range(2)
        ]
        for ours, theirs in summary["losses"]:
            assert abs(ours - theirs) <= 1e-5 * abs(theirs) + 1e-6, summary["losses"]
        assert summary["max_weight_error"] < 1e-5, summary
    finally:
        _stop(procs)
