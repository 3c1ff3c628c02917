"""Running a real ``pipesvc`` server process briefly and collecting what it logged."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def run_coordinator_briefly(
    tmp_path: Path, listen: str, global_args: tuple[str, ...] = ()
) -> tuple[int, str]:
    """Starts ``pipesvc coordinator``, waits until it serves, SIGTERMs it; returns its exit
    code and stderr.
    """
    address_file = tmp_path / "address"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipesvc",
            *global_args,
            "coordinator",
            "--listen",
            listen,
            "--state-dir",
            str(tmp_path / "state"),
            "--address-file",
            str(address_file),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not address_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert address_file.exists(), "the coordinator never reported its address"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    return proc.returncode, stderr
