"""The command line as users run it: up, status, health, and operator model modules."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pipesvc
from pipesvc import models
from pipesvc.cli import build_parser
from tests.support.processes import run_coordinator_briefly

REPO = Path(__file__).resolve().parents[2]


def _pipesvc(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipesvc", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def up_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    # A free port rather than the default 7070, which another cluster on this host may hold.
    listen = f"127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipesvc",
            "up",
            "--stages",
            "2",
            "--threads-per-stage",
            "1",
            "--listen",
            listen,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        address = ""
        while time.monotonic() < deadline and not address:
            line = proc.stdout.readline()
            if not line:
                break
            if "coordinator at" in line:
                address = line.split("coordinator at ")[1].split(",")[0].strip()
        assert address == listen, f"pipesvc up reported {address!r}, not {listen!r}"
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_up_status_health_and_clean_stop(up_process: tuple[subprocess.Popen[str], str]) -> None:
    proc, address = up_process
    status = _pipesvc("status", "--coordinator", address)
    assert status.returncode == 0, status.stderr
    rows = [line for line in status.stdout.splitlines() if line.startswith("127.0.0.1:")]
    assert len(rows) == 2
    assert all(row.rstrip().endswith("SERVING") for row in rows)
    assert "ADDRESS" in status.stdout and "LAYERS" in status.stdout
    assert "MICROBATCH/S" in status.stdout and "MB/S" not in status.stdout
    stage_addresses = [row.split()[0] for row in rows]

    assert _pipesvc("health", "--target", address).returncode == 0
    for stage in stage_addresses:
        assert _pipesvc("health", "--target", stage).returncode == 0

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    # Every process of the cluster is gone: nothing answers on their ports any more.
    for target in [address, *stage_addresses]:
        result = _pipesvc("health", "--target", target, "--timeout-s", "1")
        assert result.returncode == 1
        assert "UNREACHABLE" in result.stdout


def test_up_listens_where_status_and_trace_look() -> None:
    # `pipesvc up` then `pipesvc status` with no flags: both mean the same coordinator.
    parser = build_parser()
    up = parser.parse_args(["up"])
    assert up.listen == parser.parse_args(["status"]).coordinator
    assert up.listen == parser.parse_args(["trace", "--job", "j", "--out", "o"]).coordinator
    assert up.listen == parser.parse_args(["coordinator"]).listen


def test_health_of_nothing_fails() -> None:
    result = _pipesvc("health", "--target", "127.0.0.1:1", "--timeout-s", "0.5")
    assert result.returncode == 1


def test_status_without_coordinator_is_a_clear_error() -> None:
    result = _pipesvc("status", "--coordinator", "127.0.0.1:1", "--timeout-s", "1")
    assert result.returncode == 2
    assert "127.0.0.1:1" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_hf_model_flag_stops_the_stage_with_what_is_wrong(tmp_path: Path) -> None:
    result = _pipesvc("stage", "--hf-model", "no-equals-sign")
    assert result.returncode == 2
    assert "'no-equals-sign' is not NAME=DIR" in result.stderr
    missing = tmp_path / "missing"
    result = _pipesvc("stage", "--hf-model", f"x={missing}", "--coordinator", "127.0.0.1:1")
    assert result.returncode == 2
    assert f"Hugging Face model directory '{missing}' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_device_the_host_lacks_stops_the_stage_with_what_it_has() -> None:
    wanted = "cuda:7" if torch.cuda.is_available() else "cuda"
    result = _pipesvc("stage", "--device", wanted, "--coordinator", "127.0.0.1:1")
    assert result.returncode == 2
    assert f"device '{wanted}'" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_every_command() -> None:
    result = _pipesvc("--help")
    for command in ("coordinator", "stage", "up", "demo", "status", "job", "generate", "health"):
        assert command in result.stdout


def test_operator_model_module() -> None:
    module = "tests.support.models.tiny_models"
    with (
        pipesvc.LocalCluster(num_stages=2, models=[module], threads_per_stage=1) as cluster,
        pipesvc.connect(cluster.address) as client,
    ):
        assert all("tiny-tanh" in s.models for s in client.stages())
        with client.create_job(
            model="tiny-tanh",
            model_args={"width": 4, "depth": 3},
            num_stages=2,
            num_microbatches=2,
            loss="mse",
            optimizer={"name": "sgd", "lr": 0.1},
        ) as job:
            x, y = torch.randn(4, 4), torch.randn(4, 4)
            loss = job.train_step(x, y)
            models.import_model_modules([module])
            reference = models.build("tiny-tanh", seed=0, width=4, depth=3)
            expected = torch.nn.functional.mse_loss(reference(x), y)
            assert loss == pytest.approx(float(expected.detach()), rel=1e-6)


def test_exposed_listen_without_auth_warns(tmp_path: Path) -> None:
    returncode, stderr = run_coordinator_briefly(tmp_path, "0.0.0.0:0")
    assert returncode == 0
    assert "0.0.0.0:0 without authentication" in stderr


def test_the_coordinator_says_where_its_state_is_and_that_it_stopped(tmp_path: Path) -> None:
    # No --state-dir: the default ./pipesvc-state is created in the working directory, and
    # the log says so with its full path; SIGTERM ends with a line that the stop was clean.
    address_file = tmp_path / "address"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipesvc", "coordinator", "--listen", "127.0.0.1:0",
         "--address-file", str(address_file)],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not address_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    state = tmp_path.resolve() / "pipesvc-state"
    assert proc.returncode == 0 and state.is_dir()
    assert f"state in {state} (created)" in stderr, stderr
    assert f"coordinator stopped cleanly; state kept in {state}" in stderr, stderr


def test_a_plain_stage_restarts_itself_without_glibc_tcache() -> None:
    """``pipesvc stage`` started by hand (or in a container) gets the malloc tunables of
    [Note: stage malloc tunables] by re-executing itself: same pid, new environment."""
    import socket

    from pipesvc.stage.dataplane.malloc import STAGE_GLIBC_TUNABLES

    with socket.socket() as probe:  # a port nobody listens on: the stage keeps retrying
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipesvc",
            "stage",
            "--coordinator",
            nobody,
            "--listen",
            "127.0.0.1:0",
            "--register-timeout-s",
            "60",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        environ = b""
        while time.monotonic() < deadline and STAGE_GLIBC_TUNABLES.encode() not in environ:
            time.sleep(0.1)
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert f"GLIBC_TUNABLES={STAGE_GLIBC_TUNABLES}".encode() in environ.split(b"\0")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
