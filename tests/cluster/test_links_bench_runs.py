"""``bench/links.py`` runs end to end at one link rate (``--quick``), its traffic crosses the
shaped link (bytes, not timings, are checked), and it leaves no namespace or process behind,
also when interrupted with Ctrl-C mid-run. Needs root, ``ip`` and ``tc``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.links import why_not_runnable

REPO = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, str(REPO / "bench" / "links.py"), "--quick", "--rates", "1gbit"]


@pytest.fixture(autouse=True)
def _needs_root_and_netns() -> None:
    reason = why_not_runnable()
    if reason:
        pytest.skip(f"bench/links.py {reason}")
    probe = f"pslinks-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _hosts(line: str) -> list[str]:
    return re.findall(r"pslinks\d+-[cab]", line)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_quick_run_prints_the_table_and_cleans_up() -> None:
    result = subprocess.run(
        COMMAND, capture_output=True, text=True, timeout=240, cwd=REPO, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    hosts = _hosts(out)
    assert len(set(hosts)) == 3, out
    assert not set(hosts) & _namespaces()
    rows = {}
    for line in out.splitlines():
        match = re.match(r"1 Gbit/s\s+(torch \(float32\)|pipesvc [\w/]+)\s+(.*)", line)
        if match:
            rows[match[1]] = match[2].split()
    codecs = ("float32", "bfloat16", "int8", "int8/bf16", "int4", "auto")
    assert rows.keys() == {"torch (float32)", *(f"pipesvc {c}" for c in codecs)}, out
    assert "auto chose: rank 0 -> 1: between hosts" in out
    wire = {run: float(cells[3]) for run, cells in rows.items()}
    payload = {run: float(cells[4]) for run, cells in rows.items() if run != "torch (float32)"}
    # 8 micro-batches x 512 KiB each way in float32 (8.39 MB), half in bfloat16, int8 with a
    # float32 scale per 64 values (1.0625 bytes each), int4 (0.5625): the stages' traffic
    # crosses the shaped veth, the batch (8 MiB more) does not.
    expected = {"float32": 8.39, "bfloat16": 4.19, "int8": 2.23, "int8/bf16": 3.21, "int4": 1.18}
    for codec, megabytes in expected.items():
        assert payload[f"pipesvc {codec}"] == pytest.approx(megabytes, abs=0.01), out
        assert megabytes <= wire[f"pipesvc {codec}"] < megabytes * 1.16, out
    # auto sends exact or int8 activations with bfloat16 gradients, whichever it chose.
    assert any(payload["pipesvc auto"] == pytest.approx(expected[c], abs=0.01) for c in
               ("float32", "int8/bf16")), out  # fmt: skip
    assert 8.39 <= wire["torch (float32)"] < 9.5, out
    assert "raw TCP" in out
    losses = re.search(r"float32 ([\d.]+), .*torch ([\d.]+)", out)
    assert losses and losses[1] == losses[2], out  # the same computation on both sides


def test_ctrl_c_mid_run_removes_namespaces_and_processes() -> None:
    proc = subprocess.Popen(
        COMMAND, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.monotonic() + 180
        while "raw TCP" not in seen and time.monotonic() < deadline:  # hosts up, torch next
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        hosts = _hosts(seen)
        assert len(set(hosts)) == 3, seen
        pids = set()
        for ns in set(hosts):
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids |= {int(p) for p in out.stdout.split()}
        assert len(pids) >= 6, (seen, pids)  # coordinator, client, 4 stages (+ torch ranks)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0, seen + rest
        assert not set(hosts) & _namespaces()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], seen + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
