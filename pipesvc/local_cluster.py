"""A real cluster on loopback: one coordinator and N stage processes, as a context manager."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from pipesvc.client import Client
from pipesvc.core.health import Health
from pipesvc.errors import PipesvcError, StageUnavailableError
from pipesvc.owner import GRACE_S, owner_environ
from pipesvc.stage.dataplane.malloc import stage_environ
from pipesvc.wire.security import Security

COLOCATED_SPIN_COUNT = "100000"
"""libgomp's spins before an idle OpenMP worker sleeps, for stages that share a host's cores.

[Note: co-located stages spin less] After each parallel region a stage's OpenMP workers spin
for libgomp's default 300,000 rounds (milliseconds) before they sleep. With generation threads
([Note: generation threads] in ``pipesvc.stage.service``) stages on one host take the cores
in turns, a decode step at a time, and the workers of the stage that just finished kept
spinning into the next stage's forward and into their own stage's send: on 2 cores a one-token
activation took 2-5 ms to send. 100,000 rounds still span the gaps between the operations of
one forward (fewer made each operation wake its workers from sleep, and the forwards slower),
and end soon after it: ``bench/generate.py`` on 2 stages, runs of 8 decode steps, went from 39
to 46 tokens/s for one session and from 259 to 277 for 16. Only ``LocalCluster`` sets it, and
only when the environment does not (``GOMP_SPINCOUNT``): a stage alone on its host loses
nothing by spinning. Operators who run several stages on one host can set it the same way.
"""


def colocated_environ() -> dict[str, str]:
    """The environment ``LocalCluster`` starts a stage in: ``stage_environ()``, with
    ``GOMP_SPINCOUNT`` at ``COLOCATED_SPIN_COUNT`` unless it is set (see [Note: co-located
    stages spin less])."""
    env = stage_environ()
    env.setdefault("GOMP_SPINCOUNT", COLOCATED_SPIN_COUNT)
    return env


def default_threads_per_stage(num_stages: int) -> int:
    """Cores divided among the stages (at least one each), so stages don't oversubscribe."""
    return max(1, (os.cpu_count() or 1) // max(1, num_stages))


_ADVERTISED = re.compile(r"advertised as (\S+), device")


class LocalCluster:
    """Starts ``pipesvc coordinator`` and ``num_stages`` ``pipesvc stage`` processes.

    On ``__enter__`` it waits until every stage is registered and SERVING; on exit, or on an
    error while starting, it stops every process it started (SIGTERM, then SIGKILL). If the
    process that owns the cluster dies without either (SIGKILL, a crash, SIGTERM with the
    default handler), each child stops on its own ([Note: owned processes] in
    ``pipesvc.owner``).

    [Note: no signal handler in LocalCluster] It does not catch SIGTERM to run ``close``: a
    handler is process-wide state that belongs to the application (it may have its own, or
    install one after the block starts and so replace ours; a handler that raises lands in
    whatever code the main thread runs, and one that only sets a flag is never looked at by
    user code), only the main thread may install one, and it would still do nothing for
    SIGKILL or a crash. The children watching their owner covers every way it can die, and an
    application that wants a clean ``close`` on SIGTERM turns the signal into an exception or
    a return (``pipesvc up`` does) so ``__exit__`` runs.

    ``threads_per_stage`` is each stage's share of the host's cores (default: cores / stages);
    ``generate_threads`` its threads in a generation run (default: every core).
    ``models`` are modules every stage imports (``--models``); ``hf_models`` maps a name to a
    Hugging Face model directory every stage serves under that name (``--hf-model``).

    Usage::

        with pipesvc.LocalCluster(num_stages=4) as cluster:
            client = pipesvc.connect(cluster.address)
    """

    def __init__(
        self,
        num_stages: int = 2,
        *,
        models: Sequence[str] = (),
        hf_models: Mapping[str, str | Path] | None = None,
        threads_per_stage: int | None = None,
        generate_threads: int | None = None,
        device: str | None = None,
        state_dir: str | Path | None = None,
        startup_timeout_s: float = 120.0,
        token_file: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls_ca: str | Path | None = None,
        stage_args: Sequence[str] = (),
        coordinator_args: Sequence[str] = (),
        listen: str = "127.0.0.1:0",
        separate_hosts: bool = False,
    ) -> None:
        if num_stages < 1:
            raise ValueError(f"num_stages ({num_stages}) must be at least 1")
        self.num_stages = num_stages
        self.models = list(models)
        self.hf_models = {name: Path(d).resolve() for name, d in (hf_models or {}).items()}
        self.threads_per_stage = threads_per_stage or default_threads_per_stage(num_stages)
        self.generate_threads = generate_threads or os.cpu_count() or 1
        """torch threads of a stage's generation runs: every core by default, since a
        generation step's stages compute one after another (see [Note: generation threads]
        in ``pipesvc.stage.service``)."""
        self.device = device
        self.startup_timeout_s = startup_timeout_s
        self._state_dir = Path(state_dir) if state_dir else None
        self.security = Security.from_files(
            token_file=token_file, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca
        )
        self._security_args: list[str] = []
        for flag, value in (
            ("--token-file", token_file),
            ("--tls-cert", tls_cert),
            ("--tls-key", tls_key),
            ("--tls-ca", tls_ca),
        ):
            if value:
                self._security_args += [flag, str(value)]
        self.stage_args = list(stage_args)
        self.coordinator_args = list(coordinator_args)
        self.listen = listen
        """The coordinator's HOST:PORT (port 0: any free one; ``address`` has the real one)."""
        self.separate_hosts = separate_hosts
        """Each stage listens on a loopback address of its own (127.0.0.2, 127.0.0.3, ...;
        Linux routes all of 127/8 to the loopback device), so the links between stages count
        as links between hosts: the job's ``wire_dtype`` applies to them (see [Note: codecs
        per link] in ``pipesvc.core.link_codecs``). Shared memory still joins them."""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self.address = ""
        self.log_dir = Path()
        self._stage_count = 0
        self._control: Client | None = None
        self._coordinator: subprocess.Popen[bytes] | None = None

    def _spawn(
        self, name: str, args: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipesvc", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=owner_environ(env),
        )
        log.close()
        self._procs.append(proc)
        return proc

    def _start_coordinator(self, listen: str) -> None:
        state_dir = self._state_dir or self.log_dir / "state"
        address_file = self.log_dir / "coordinator.address"
        address_file.unlink(missing_ok=True)
        self._coordinator = self._spawn(
            "coordinator",
            [
                "coordinator",
                "--listen",
                listen,
                "--state-dir",
                str(state_dir),
                "--address-file",
                str(address_file),
                *self._security_args,
                *self.coordinator_args,
            ],
        )
        self._wait(address_file.exists, "starting the coordinator", [self._coordinator])
        self.address = address_file.read_text().strip()

    def restart_coordinator(self, *, kill: bool = True) -> None:
        """Stops the coordinator (SIGKILL, or SIGTERM with ``kill=False``) and starts a new
        one on the same address and state directory; its stages re-register on their own.

        Raises:
            StageUnavailableError: the new coordinator did not come up.
        """
        if self._coordinator is None:
            raise StageUnavailableError("the cluster has not started")
        self._coordinator.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        self._coordinator.wait(timeout=30)
        if self._control is not None:
            self._control.close()
            self._control = None
        self._start_coordinator(self.address)

    def _spawn_stage(self, extra_args: Sequence[str]) -> subprocess.Popen[bytes]:
        args = [
            "stage",
            "--coordinator",
            self.address,
            "--listen",
            f"127.0.0.{2 + self._stage_count}:0" if self.separate_hosts else "127.0.0.1:0",
            "--threads",
            str(self.threads_per_stage),
            "--generate-threads",
            str(self.generate_threads),
        ]
        if self.device:
            args += ["--device", self.device]
        for module in self.models:
            args += ["--models", module]
        for name, directory in self.hf_models.items():
            args += ["--hf-model", f"{name}={directory}"]
        args += [*self._security_args, *self.stage_args, *extra_args]
        self._stage_count += 1
        return self._spawn(f"stage-{self._stage_count - 1}", args, colocated_environ())

    def add_stage(self, extra_args: Sequence[str] = ()) -> int:
        """Starts one more stage process (e.g. a spare, or one with its own flags) and waits
        until it is registered and SERVING; returns its pid.

        Raises:
            StageUnavailableError: it did not come up in time.
        """
        proc = self._spawn_stage(extra_args)
        log = self.log_dir / f"stage-{self._stage_count - 1}.log"

        def registered() -> bool:
            # By the address the stage itself reports: a port freed by a dead stage can be
            # reused by the new one, so "an address not seen before" may never appear.
            found = _ADVERTISED.search(log.read_text(errors="replace"))
            if found is None:
                return False
            stages = self._client().stages()
            return any(s.address == found[1] and s.health == Health.SERVING for s in stages)

        self._wait(registered, "waiting for the added stage", [proc])
        return proc.pid

    def _client(self) -> Client:
        if self._control is None:
            self._control = self.connect(timeout_s=5.0)
        return self._control

    def _logs(self) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            tail = path.read_text(errors="replace")[-2000:]
            parts.append(f"--- {path.name} ---\n{tail}")
        return "\n".join(parts)

    def _wait(
        self, ready: object, what: str, procs: list[subprocess.Popen[bytes]] | None = None
    ) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in (self._procs if procs is None else procs)):
                raise StageUnavailableError(f"a process exited while {what}:\n{self._logs()}")
            assert callable(ready)
            if ready():
                return
            time.sleep(0.1)
        raise StageUnavailableError(
            f"timed out after {self.startup_timeout_s} s {what}:\n{self._logs()}"
        )

    def start(self) -> LocalCluster:
        """Starts the processes and waits until the cluster is ready.

        Raises:
            StageUnavailableError: a process died or the cluster was not ready in time.
        """
        self._tmp = tempfile.TemporaryDirectory(prefix="pipesvc-cluster-")
        self.log_dir = Path(self._tmp.name)
        try:
            self._start_coordinator(self.listen)
            for _ in range(self.num_stages):
                self._spawn_stage([])
            with self.connect(timeout_s=5.0) as client:

                def all_serving() -> bool:
                    try:
                        stages = client.stages()
                    except PipesvcError:
                        return False
                    serving = [s for s in stages if s.health == Health.SERVING]
                    return len(serving) >= self.num_stages

                self._wait(all_serving, f"waiting for {self.num_stages} stages")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stops every process this cluster started and removes its temporary files."""
        if self._control is not None:
            self._control.close()
            self._control = None
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S  # what an orphan gives itself, too
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def connect(self, timeout_s: float = 600.0) -> Client:
        """A client for this cluster's coordinator, with its token and TLS."""
        return Client(self.address, security=self.security, timeout_s=timeout_s)

    @property
    def pids(self) -> list[int]:
        """Process ids of the coordinator (first) and the stages."""
        return [p.pid for p in self._procs]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
