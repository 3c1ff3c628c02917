"""The README's command-line examples run as written, as real processes: from the demo (or
`pipesvc up` and `pipesvc job create`) to `pipesvc generate`, and `pipesvc job list|close`."""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_commands(marker: str) -> list[list[str]]:
    """The commands of the README's bash block that contains ``marker``, one per line,
    without comments; ``JOB=$(cmd)`` gives ``cmd``."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    [block] = [b for b in blocks if marker in b]
    commands = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0].startswith("JOB=$("):
            words = [words[0].removeprefix("JOB=$("), *words[1:]]
            words[-1] = words[-1].removesuffix(")")
        assert words[0] == "pipesvc", line
        commands.append(words[1:])
    return commands


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def pipesvc(args: list[str], job: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    args = [job if word in ("JOB_ID", "$JOB") else word for word in args]
    return subprocess.run(
        [sys.executable, "-m", "pipesvc", *args],
        capture_output=True, text=True, timeout=180, check=False, cwd=cwd,
    )  # fmt: skip


@contextmanager
def running(args: list[str], cwd: Path, until: str) -> Iterator[tuple[str, list[str]]]:
    """``pipesvc ARGS`` in the background until it prints a line containing ``until``; yields
    that line and what it printed before; stops it with Ctrl-C (SIGINT) and expects exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipesvc", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=cwd,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        lines: list[str] = []
        while not lines or until not in lines[-1]:
            line = proc.stdout.readline()
            assert line, f"`pipesvc {shlex.join(args)}` ended early: {lines}"
            lines.append(line)
        yield lines[-1], lines[:-1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_the_generate_example_runs_on_the_demos_kept_job(tmp_path: Path) -> None:
    demo, generate = readme_commands("pipesvc generate --job JOB_ID")
    assert demo[:1] == ["demo"] and "--keep-job" in demo
    address = _free_address()  # not 7070, which another cluster on this host may hold
    demo += ["--max-steps", "3", "--stages", "2", "--listen", address]
    with running(demo, tmp_path, until="kept open") as (kept, before):
        job = kept.split()[1]
        assert re.fullmatch(r"job \w+ kept open; for example\n", kept)
        listed = pipesvc(["job", "list", "--coordinator", address], job, tmp_path)
        out = pipesvc([*generate, "--coordinator", address], job, tmp_path)
        # The README's old request (9 + 64 positions) is refused before any text is printed.
        long = [*generate, "--coordinator", address, "--max-new-tokens", "64"]
        refused = pipesvc(long, job, tmp_path)
        closed = pipesvc(["job", "close", job, "--coordinator", address], job, tmp_path)
        again = pipesvc(["job", "close", job, "--coordinator", address], job, tmp_path)
        after = pipesvc(["job", "list", "--coordinator", address], job, tmp_path)
    assert any("sample through the pipeline" in line for line in before)
    assert listed.returncode == 0, listed.stderr
    [row] = [line.split() for line in listed.stdout.splitlines() if line.startswith(job)]
    assert row[1:4] == ["gpt", "3", "2"], listed.stdout
    assert out.returncode == 0, out.stderr
    # One character per token: the prompt and 48 new ones.
    assert out.stdout.startswith("def main(") and len(out.stdout) == 9 + 48 + 1, out.stdout
    assert refused.returncode == 2 and refused.stdout == ""
    assert "InvalidArgumentError" in refused.stderr
    assert "9 tokens + max_new_tokens 64" in refused.stderr
    assert "maximum of 64" in refused.stderr
    assert closed.returncode == 0 and f"closed job {job}" in closed.stdout, closed.stderr
    assert again.returncode == 2 and "NotFoundError" in again.stderr
    assert after.stdout.splitlines()[-1] == f"0 open job(s) on {address}"


def test_the_hugging_face_commands_run_on_the_examples_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    [example] = [b for b in blocks if b.startswith("# Bring a Hugging Face model")]
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})  # our own README, not input
    assert (tmp_path / "tiny-llama" / "tokenizer.json").is_file()
    up, create, generate, close = readme_commands("JOB=$(pipesvc job create")
    address = _free_address()
    up += ["--listen", address, "--threads-per-stage", "1"]
    with running(up, tmp_path, until="coordinator at"):
        created = pipesvc([*create, "--coordinator", address], "", tmp_path)
        job = created.stdout.strip()
        out = pipesvc([*generate, "--coordinator", address], job, tmp_path)
        closed = pipesvc([*close, "--coordinator", address], job, tmp_path)
    assert created.returncode == 0 and re.fullmatch(r"\w+\n", created.stdout), created
    assert "rank 1: layers" in created.stderr
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def main(") and len(out.stdout) > len("def main(\n")
    assert closed.returncode == 0, closed.stderr
