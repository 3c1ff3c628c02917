"""Training across a slow link: pipesvc against torch.distributed.pipelining, the two stages
on two hosts joined by a link shaped to 10 Gbit/s, 1 Gbit/s and 100 Mbit/s.

Hosts are network namespaces this script creates (names end in its pid, so a concurrent run
or test cannot collide with them) and removes, with every process it started, at the end, on
an error, on Ctrl-C and on SIGTERM:

- ``c``: the coordinator and the client, with a bridge ``10.81.0.1/24``;
- ``a`` and ``b``: one stage host each, joined to the bridge by a veth (``10.81.0.10``,
  ``.11``: the unshaped control links, which also carry the batch from the coordinator) and to
  each other by a second veth, the shaped link (``10.81.1.1`` and ``.2``). The stages listen
  (and torch's gloo binds, ``GLOO_SOCKET_IFNAME``) on the shaped link's addresses, so
  everything between the two stages crosses it; ``c`` reaches those addresses through the
  control links (a host route each). Each stage host has its own ``/dev/shm``, so pipesvc's
  stages cannot use shared memory and send frames on the gRPC stream, as between hosts.

Shaping: ``tc qdisc replace ... root tbf`` on both ends of the shaped veth (each direction at
the full rate, as on a full-duplex link), ``burst`` 1 ms at the rate but at least 64 KiB (veth
hands tbf segments of up to 64 KiB; the kernel's qdisc watchdog is a high-resolution timer,
so the old ``rate/HZ`` rule is not needed and a larger burst would let short exchanges beat
the rate), ``latency 50ms`` (the queue tbf keeps: rate x 50 ms + burst). There is no netem
here, so the link has a rate and a queue but no added delay. Each rate is checked first by a
raw TCP transfer across the link (python sockets, about 1 s of the rate), printed as a sanity
table.

Model: ``bench/pipeline.py``'s ``act`` workload, 8 x (Linear(256, 256) + ReLU) (activation
heavy: 512 KiB of float32 activations per micro-batch), batch 4096 in 8 micro-batches, MSE,
SGD (lr 1e-3), uniform split over 2 stages, one torch thread per stage process, 1F1B
(``--schedule``). Checkpoints off (torch has none).

Rows per link rate, in interleaved rounds (the order rotates every round) so that all see the
same load:

- **torch**: ``bench/pipeline.py``'s ``_torch_stage`` (``PipelineStage`` + ``Schedule1F1B``,
  gloo), rank 0 on host ``a`` and rank 1 on host ``b``, started afresh each round (3 warm-up
  steps), timed on rank 0 between two barriers. Activations and gradients in float32.
- **pipesvc float32** and **pipesvc bfloat16** (``wire_dtype``): two jobs on the same two
  stage processes (one on each host), created once; each round 1 warm-up step, then the timed
  steps from the client's ``job.train_step`` (so each step also pays for the batch's trip from
  the client through the coordinator to the stages, and for the commit). With ``--train``
  the timed steps go through ``job.train`` instead (one stream; each step's run sent ahead of
  the step before's decision).

Columns: steps/s (median over the rounds, and their range), ``x torch`` (the median over the
rounds of each round's ratio to that round's torch), ``wire MB/step``: bytes both ways on the
shaped veth (``ip -s link``: rx + tx of host ``a``'s end, Ethernet frames with their headers,
over the timed window) per step, the same count for pipesvc and torch; ``payload MB/step``:
pipesvc's own ``pipesvc_bytes_total{direction="sent"}`` counter (tensor bytes sent by both
stages, after the ``wire_dtype`` cast; scraped from the stages' ``--metrics-port``); ``link
busy``: the busier direction's bytes per second over its rate (1.00: the link is the bound).

Needs root (``ip netns``, ``tc``). Usage:
``python bench/links.py [--quick] [--rates 10gbit,1gbit,100mbit] [--steps 20] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, ClassVar

REPO_ROOT = Path(__file__).resolve().parents[1]
COORDINATOR_PORT, STAGE_PORT, METRICS_PORT, TCP_PORT, GLOO_PORT = 7071, 50051, 9464, 5201, 29500
DEFAULT_RATES = "10gbit,1gbit,100mbit"
CODECS: dict[str, str | dict[str, str] | None] = {
    "float32": None,
    "bfloat16": "bfloat16",
    "int8": "int8",
    "int8/bf16": {"activations": "int8", "gradients": "bfloat16"},
    "int4": "int4",
    "auto": "auto",
}
"""pipesvc's rows by name, with the ``wire_dtype`` each job gets (``a/g``: activations in
``a``, gradients in ``g``). ``auto`` re-plans for throughput before each round's timed steps
(after ``AUTO_SETTLE_STEPS`` steps at the round's rate, so the stages' compute timings are the
round's), which probes the link and decides its codecs by the probed rate (see [Note: link
probe] in ``pipesvc.stage.net.probe``); the round prints what it chose and the rate."""
AUTO_SETTLE_STEPS = 3
"""Steps the ``auto`` row runs at a new rate before it re-plans (see ``CODECS``)."""
RUNS = ("torch", *CODECS)
"""The rows of each link by default: torch, then pipesvc with each codec (``--codecs``)."""
MIN_BURST_BYTES = 64 * 1024
TBF_LATENCY = "50ms"
WORKLOAD = "act"
"""``bench/pipeline.py``'s workload name (and the model, batch and loss behind it)."""

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class Rate:
    """A link rate as ``tc`` spells it (``100mbit``), or ``none`` for the veth unshaped."""

    text: str
    bits_per_s: int | None

    @classmethod
    def parse(cls, text: str) -> Rate:
        """``10gbit``, ``1gbit``, ``100mbit``, ``500kbit``, ``none``; raises ValueError
        naming the text otherwise."""
        if text == "none":
            return cls(text, None)
        match = re.fullmatch(r"(\d+)([kmgt]?)bit", text)
        if not match:
            raise ValueError(f"link rate {text!r}: expected e.g. 10gbit, 1gbit, 100mbit or none")
        bits = int(match[1]) * _UNITS[match[2]]
        if bits <= 0:
            raise ValueError(f"link rate {text!r}: expected a positive rate")
        return cls(text, bits)

    @property
    def label(self) -> str:
        if self.bits_per_s is None:
            return "unshaped"
        value, unit = (
            (self.bits_per_s / 1e9, "Gbit/s")
            if self.bits_per_s >= 10**9
            else (self.bits_per_s / 1e6, "Mbit/s")
        )
        return f"{value:g} {unit}"

    @property
    def burst_bytes(self) -> int:
        """tbf's bucket: 1 ms at the rate, at least 64 KiB (see the module docstring)."""
        assert self.bits_per_s is not None
        return max(self.bits_per_s // 8 // 1000, MIN_BURST_BYTES)

    def tc_command(self, netns: str, dev: str) -> list[str]:
        """The command that sets this rate on ``dev``'s egress in ``netns`` (replacing any
        qdisc there), or for ``none`` removes the root qdisc."""
        if self.bits_per_s is None:
            return ["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"]
        return [
            "tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", self.text, "burst", str(self.burst_bytes), "latency", TBF_LATENCY,
        ]  # fmt: skip


@dataclass(frozen=True)
class Topology:
    """Names, addresses and the ``ip`` commands of the three hosts; ``tag`` (the pid) keeps
    the names apart from any other run's."""

    tag: str

    @property
    def netns(self) -> dict[str, str]:
        return {host: f"pslinks{self.tag}-{host}" for host in ("c", "a", "b")}

    @property
    def shaped_dev(self) -> str:
        """The shaped veth's end in ``a`` and in ``b`` (one name in each namespace)."""
        return f"lk{self.tag}s"

    def control_dev(self, host: str) -> str:
        return f"lk{self.tag}{host}"

    def bridge_port(self, host: str) -> str:
        return f"lk{self.tag}{host}p"

    @property
    def bridge(self) -> str:
        return f"lk{self.tag}br"

    coordinator_ip: ClassVar[str] = "10.81.0.1"
    control_ip: ClassVar[dict[str, str]] = {"a": "10.81.0.10", "b": "10.81.0.11"}
    shaped_ip: ClassVar[dict[str, str]] = {"a": "10.81.1.1", "b": "10.81.1.2"}

    @property
    def coordinator(self) -> str:
        return f"{self.coordinator_ip}:{COORDINATOR_PORT}"

    def setup_commands(self) -> list[list[str]]:
        """Every ``ip`` command that builds the hosts, in order (no shaping yet)."""
        ns = self.netns
        commands = [["ip", "netns", "add", name] for name in ns.values()]
        commands += [["ip", "-n", name, "link", "set", "lo", "up"] for name in ns.values()]
        commands += [
            ["ip", "-n", ns["c"], "link", "add", self.bridge, "type", "bridge"],
            ["ip", "-n", ns["c"], "addr", "add", f"{self.coordinator_ip}/24", "dev", self.bridge],
            ["ip", "-n", ns["c"], "link", "set", self.bridge, "up"],
        ]
        for host in ("a", "b"):
            dev, port = self.control_dev(host), self.bridge_port(host)
            commands += [
                ["ip", "link", "add", dev, "netns", ns[host], "type", "veth",
                 "peer", "name", port, "netns", ns["c"]],
                ["ip", "-n", ns[host], "addr", "add", f"{self.control_ip[host]}/24", "dev", dev],
                ["ip", "-n", ns[host], "link", "set", dev, "up"],
                ["ip", "-n", ns["c"], "link", "set", port, "master", self.bridge],
                ["ip", "-n", ns["c"], "link", "set", port, "up"],
            ]  # fmt: skip
        dev = self.shaped_dev
        commands.append(
            ["ip", "link", "add", dev, "netns", ns["a"], "type", "veth",
             "peer", "name", dev, "netns", ns["b"]]
        )  # fmt: skip
        for host in ("a", "b"):
            commands += [
                ["ip", "-n", ns[host], "addr", "add", f"{self.shaped_ip[host]}/24", "dev", dev],
                ["ip", "-n", ns[host], "link", "set", dev, "up"],
                # c reaches the stages' (shaped-link) addresses over their control links.
                ["ip", "-n", ns["c"], "route", "add", f"{self.shaped_ip[host]}/32",
                 "via", self.control_ip[host]],
            ]  # fmt: skip
        return commands

    def teardown_commands(self) -> list[list[str]]:
        """Deleting the namespaces deletes the veths and the bridge in them."""
        return [["ip", "netns", "del", name] for name in self.netns.values()]

    def shape_commands(self, rate: Rate) -> list[list[str]]:
        return [rate.tc_command(self.netns[host], self.shaped_dev) for host in ("a", "b")]


def _run(command: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


def why_not_runnable() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


def link_counters(netns: str, dev: str) -> tuple[int, int]:
    """(rx, tx) bytes of ``dev`` in ``netns`` so far."""
    out = _run(["ip", "-n", netns, "-j", "-s", "link", "show", "dev", dev]).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


# --- processes started inside the hosts ----------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


class Processes:
    """Every process this run started, stopped by pid at the end."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[Any]] = []

    def start(
        self,
        netns: str,
        argv: list[str],
        *,
        own_shm: bool = False,
        stdin: int | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[Any]:
        """Runs ``argv`` in ``netns`` (``ip netns exec``, which execs it: the pid is the
        command's), in a session of its own so that Ctrl-C reaches only this script, which
        stops it. ``own_shm``: a private ``/dev/shm``, as on another host."""
        if own_shm:
            shm = 'mount -t tmpfs -o size=64m pslinks-shm /dev/shm && exec "$0" "$@"'
            argv = ["sh", "-c", shm, *argv]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, *argv],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=REPO_ROOT,
            env=env or _env(),
            start_new_session=True,
            text=True,
        )
        self._procs.append(proc)
        return proc

    def stop(self, procs: Sequence[subprocess.Popen[Any]] | None = None) -> None:
        """SIGTERM, up to 20 s, then SIGKILL; by pid, only ours."""
        chosen = list(self._procs if procs is None else procs)
        for proc in chosen:
            if proc.poll() is None:
                proc.terminate()
        for proc in chosen:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc in self._procs:
                self._procs.remove(proc)


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            value: dict[str, Any] = json.loads(line)
            return value
    return None


# --- the raw TCP sanity check ----------------------------------------------------------------


def tcp_sink(address: str, num_bytes: int) -> None:
    """Accepts one connection, receives ``num_bytes``; prints the seconds from the first byte
    to the last as JSON."""
    host, port = address.rsplit(":", 1)
    with socket.create_server((host, int(port))) as server:
        print(json.dumps({"listening": True}), flush=True)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(1 << 20)
            got = conn.recv_into(buf)
            started = time.perf_counter()
            while got < num_bytes:
                n = conn.recv_into(buf)
                if n == 0:
                    sys.exit(f"the sender closed after {got} of {num_bytes} bytes")
                got += n
            seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "bytes": got}), flush=True)


def tcp_source(address: str, num_bytes: int) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((host, int(port)), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunk = bytes(1 << 20)
        left = num_bytes
        while left > 0:
            conn.sendall(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))


# --- torch ranks -------------------------------------------------------------------------------


class _PrintQueue:
    """What ``bench/pipeline.py``'s stage functions put results on: here, kept for stdout."""

    def __init__(self) -> None:
        self.items: dict[str, Any] = {}

    def put(self, item: tuple[str, Any]) -> None:
        self.items[item[0]] = item[1]


def torch_rank(rank: int, address: str, schedule: str, steps: int, counters: str) -> None:
    """One rank of the torch pipeline (``bench/pipeline.py``'s ``_torch_stage``); rank 0 reads
    the shaped link's counters (``counters``: NETNS:DEV) at the edges of the timed window."""
    sys.path.insert(0, str(REPO_ROOT))
    from bench import pipeline as base

    netns, dev = counters.split(":")
    marks: list[tuple[int, int]] = []
    q = _PrintQueue()
    mark: Callable[[], None] | None = (
        (lambda: marks.append(link_counters(netns, dev))) if rank == 0 else None
    )
    base._torch_stage(q, WORKLOAD, rank, 2, address, schedule, steps, mark)
    print(json.dumps({**q.items, "marks": marks}), flush=True)


# --- the pipesvc client (inside host c) ------------------------------------------------------


def metrics_port(stage_port: int) -> int:
    """The ``--metrics-port`` of the stage listening on ``stage_port`` (two per host)."""
    return METRICS_PORT + stage_port - STAGE_PORT


def _scrape_sent_bytes(addresses: list[str]) -> float | None:
    """Sum over the stages of ``pipesvc_bytes_total{direction="sent"}``, or None when a
    stage serves no metrics."""
    total = 0.0
    for address in addresses:
        host, port = address.rsplit(":", 1)
        try:
            url = f"http://{host}:{metrics_port(int(port))}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("pipesvc_bytes_total{") and 'direction="sent"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_for_stages(client: Any, count: int) -> None:
    """Until ``count`` stages are registered and serving (the coordinator may not listen
    yet)."""
    import pipesvc

    deadline = time.monotonic() + 120
    while True:
        try:
            if sum(s.health == "SERVING" for s in client.stages()) >= count:
                return
        except pipesvc.PipesvcError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{count} stages did not register within 120 s")
        time.sleep(0.2)


def pipesvc_client(coordinator: str, schedule: str, counters: str, runs: Sequence[str]) -> None:
    """Creates the first run's job on the first pair of stages (the only ones registered
    yet), says so (``{"created": ...}``) and waits for the next pair, on which it creates the
    next run's job, and so on; then serves rounds: reads ``{"run": "float32", "steps": N}``
    lines on stdin, answers one JSON line each on stdout.

    A stage serves one job at a time: a pair per run keeps every job warm between rounds."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    import pipesvc
    from bench import pipeline as base
    from pipesvc.core.planning.partition import uniform
    from pipesvc.v1 import stage_pb2, stage_pb2_grpc
    from pipesvc.wire.security import Security
    from pipesvc.wire.transport import open_channel

    torch.set_num_threads(1)
    netns, dev = counters.split(":")
    w = base.WORKLOADS[WORKLOAD]
    x, y = base._batch(w)
    client = pipesvc.connect(coordinator, timeout_s=600)
    jobs, first_loss = {}, {}
    for pair, run in enumerate(runs):
        _wait_for_stages(client, 2 * (pair + 1))
        job = client.create_job(
            model=w.model,
            model_args=w.model_args,
            num_stages=2,
            num_microbatches=base.NUM_MICROBATCHES,
            schedule=schedule,
            optimizer={"name": "sgd", "lr": base.LR},
            loss=w.loss,
            partition="uniform",
            checkpoint_every=0,
            wire_dtype=CODECS[run],
        )
        plan = [(s.start_layer, s.end_layer) for s in job.plan]
        if plan != uniform(w.num_layers, 2):  # the torch ranks slice the model this way
            sys.exit(f"pipesvc planned {plan}, torch uses {uniform(w.num_layers, 2)}")
        hosts = {s.address.rsplit(":", 1)[0] for s in job.plan}
        if len(hosts) != 2:
            sys.exit(f"the {run} job's stages are not on two hosts: {job.plan}")
        first_loss[run] = job.train_step(x, y)
        for _ in range(base.WARMUP_STEPS - 1):
            job.train_step(x, y)
        jobs[run] = job
        print(json.dumps({"created": run}), flush=True)
    plans = {run: [s.address for s in job.plan] for run, job in jobs.items()}
    shm = []
    for address in (a for addresses in plans.values() for a in addresses):
        channel = open_channel(address, Security())  # separate hosts: never shared memory
        try:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            info = stub.Info(stage_pb2.InfoRequest(), timeout=10)
        finally:
            channel.close()
        shm += [info.downstream_shm, info.upstream_shm]
    print(
        json.dumps({"ready": True, "plans": plans, "shm": shm, "first_loss": first_loss}),
        flush=True,
    )
    for line in sys.stdin:
        request = json.loads(line)
        job, steps = jobs[request["run"]], int(request["steps"])
        addresses = plans[request["run"]]
        job.train_step(x, y)  # warm-up: the link's rate may just have changed
        chose = None
        if CODECS[request["run"]] == "auto":
            for _ in range(AUTO_SETTLE_STEPS):
                job.train_step(x, y)
            job.replan("throughput")
            chose = "; ".join(link.describe(2) for link in job.links)
            addresses = plans[request["run"]] = [s.address for s in job.plan]
            job.train_step(x, y)  # warm-up on the plan it chose
        sent_before = _scrape_sent_bytes(addresses)
        before = link_counters(netns, dev)
        started = time.perf_counter()
        if request.get("train"):
            for _ in job.train([(x, y)] * steps):
                pass
        else:
            for _ in range(steps):
                job.train_step(x, y)
        seconds = time.perf_counter() - started
        after = link_counters(netns, dev)
        sent_after = _scrape_sent_bytes(addresses)
        payload = None if sent_before is None or sent_after is None else sent_after - sent_before
        print(
            json.dumps(
                {"seconds": seconds, "marks": [before, after], "payload": payload, "auto": chose}
            ),
            flush=True,
        )
    for job in jobs.values():
        job.close()
    client.close()


# --- the orchestrator (in the host's own namespace) ------------------------------------------


@dataclass
class Sample:
    """One timed round of one run."""

    steps_per_s: float
    wire_bytes: float
    """rx + tx per step on the shaped link."""
    busiest_bytes: float
    """The busier direction's bytes per step."""
    payload_bytes: float | None
    """pipesvc's own sent-bytes counter per step (None for torch)."""


def _sample(steps: int, seconds: float, marks: list[list[int]], payload: float | None) -> Sample:
    (rx0, tx0), (rx1, tx1) = marks
    return Sample(
        steps_per_s=steps / seconds,
        wire_bytes=(rx1 - rx0 + tx1 - tx0) / steps,
        busiest_bytes=max(rx1 - rx0, tx1 - tx0) / steps,
        payload_bytes=None if payload is None else payload / steps,
    )


class Bench:
    """Builds the hosts and processes, runs the rounds, and tears everything down."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args = args
        self.logs = logs
        self.runs: list[str] = args.codecs.split(",")
        """pipesvc's runs, one pair of stages each."""
        self.topo = Topology(str(os.getpid()))
        self.procs = Processes()
        self._client: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._torch_rounds = 0
        self.first_loss: dict[str, float] = {}

    # setup ------------------------------------------------------------------------------

    def build_hosts(self) -> None:
        for command in self.topo.setup_commands():
            _run(command)

    def remove_hosts(self) -> None:
        for command in self.topo.teardown_commands():
            _run(command, check=False)

    def shape(self, rate: Rate) -> None:
        for command in self.topo.shape_commands(rate):
            _run(command, check=rate.bits_per_s is not None)  # deleting none is fine

    def _log(self, name: str) -> IO[Any]:
        return open(self.logs / f"{name}.log", "w")

    def _start_stages(self, pair: int) -> None:
        """A stage on each of ``a`` and ``b``, on the shaped link's address; ``pair`` k (port
        50051 + k) serves the job of the k-th pipesvc run."""
        topo = self.topo
        port = STAGE_PORT + pair
        for host in ("a", "b"):
            self.procs.start(
                topo.netns[host],
                [sys.executable, "-m", "pipesvc", "stage", "--coordinator", topo.coordinator,
                 "--listen", f"{topo.shaped_ip[host]}:{port}", "--threads", "1",
                 "--models", "bench.bench_models", "--metrics-port", str(metrics_port(port)),
                 "--drain-timeout-s", "1"],
                own_shm=True, stdout=self._log(f"stage-{host}{pair}"), stderr=subprocess.STDOUT,
            )  # fmt: skip

    def start_pipesvc(self) -> dict[str, Any]:
        topo, ns = self.topo, self.topo.netns
        python = [sys.executable, "-m", "pipesvc"]
        self.procs.start(
            ns["c"],
            [*python, "coordinator", "--listen", topo.coordinator,
             "--state-dir", str(self.logs / "state")],
            stdout=self._log("coordinator"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._start_stages(0)
        self._client = self.procs.start(
            ns["c"],
            [sys.executable, __file__, "--client", topo.coordinator,
             "--schedule", self.args.schedule,
             "--counters", f"{ns['a']}:{topo.shaped_dev}", "--codecs", ",".join(self.runs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log("client"),
        )  # fmt: skip
        out = self._client.stdout
        assert out is not None

        def read() -> None:
            for line in out:
                self._lines.put(line)
            self._lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        self._answer("created", timeout_s=300)  # the first run's job, on the first pair
        for pair in range(1, len(self.runs)):
            self._start_stages(pair)
            self._answer("created", timeout_s=300)
        ready = self._answer("ready", timeout_s=300)
        if any(ready["shm"]):
            raise RuntimeError(f"the stages use shared memory across hosts: {ready}")
        self.first_loss = ready["first_loss"]
        return ready

    def _answer(self, key: str, timeout_s: float) -> dict[str, Any]:
        """The client's next JSON line, which must hold ``key``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"the pipesvc client did not answer within {timeout_s} s"
                ) from None
            if line is None:
                raise RuntimeError("the pipesvc client exited")
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                if key not in answer:
                    raise RuntimeError(f"the pipesvc client answered {answer}, expected {key!r}")
                return answer

    # runs -------------------------------------------------------------------------------

    def tcp_check(self, rate: Rate) -> float:
        """Raw TCP Mbit/s across the shaped link, a -> b."""
        ns, dev_ip = self.topo.netns, self.topo.shaped_ip
        num_bytes = min((rate.bits_per_s or 8 * 10**9) // 8, 10**9)  # ~1 s of the rate
        address = f"{dev_ip['b']}:{TCP_PORT}"
        me = [sys.executable, __file__]
        sink = self.procs.start(
            ns["b"], [*me, "--tcp-sink", address, "--bytes", str(num_bytes)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ),
        )  # fmt: skip
        source = self.procs.start(
            ns["a"], [*me, "--tcp-source", address, "--bytes", str(num_bytes)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ),
        )  # fmt: skip
        try:
            out, _ = sink.communicate(timeout=120)
        finally:
            self.procs.stop([sink, source])
        result = _last_json(out)
        if result is None or "seconds" not in result:
            raise RuntimeError(f"the TCP check at {rate.text} failed: {out[-2000:]}")
        return 8 * float(result["bytes"]) / float(result["seconds"]) / 1e6

    def torch_round(self, steps: int) -> Sample:
        ns, topo = self.topo.netns, self.topo
        self._torch_rounds += 1
        # A fresh port each round: the last round's store may still be in TIME_WAIT.
        address = f"{topo.shaped_ip['a']}:{GLOO_PORT + self._torch_rounds}"
        env = _env(GLOO_SOCKET_IFNAME=topo.shaped_dev)
        counters = f"{ns['a']}:{topo.shaped_dev}"
        argv = [sys.executable, __file__, "--address", address, "--steps", str(steps),
                "--schedule", self.args.schedule, "--counters", counters]  # fmt: skip
        ranks = []
        for rank, host in enumerate(("a", "b")):
            ranks.append(
                self.procs.start(
                    ns[host],
                    [*argv, "--torch-rank", str(rank)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
        outs = []
        try:
            for proc in ranks:
                out, _ = proc.communicate(timeout=max(300, 10 * steps))
                outs.append(out)
        finally:
            self.procs.stop(ranks)
        results = [_last_json(out) or {} for out in outs]
        for rank, result in enumerate(results):
            if "error" in result or not result:
                raise RuntimeError(f"torch rank {rank} failed:\n{outs[rank][-3000:]}")
        self.first_loss.setdefault("torch", float(results[1]["loss"]))
        return _sample(steps, float(results[0]["seconds"]), results[0]["marks"], None)

    def pipesvc_round(self, run: str, steps: int) -> Sample:
        assert self._client is not None and self._client.stdin is not None
        request = {"run": run, "steps": steps, "train": self.args.train}
        self._client.stdin.write(json.dumps(request) + "\n")
        self._client.stdin.flush()
        answer = self._answer("seconds", timeout_s=max(300, 10 * steps))
        if answer.get("auto"):
            print(f"  auto chose: {answer['auto']}", flush=True)
        return _sample(steps, answer["seconds"], answer["marks"], answer["payload"])

    def close_client(self) -> None:
        """Lets the client close its jobs and exit (the stages then stop quickly)."""
        if self._client is not None and self._client.stdin is not None:
            self._client.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._client.wait(timeout=30)

    def print_logs(self) -> None:
        for log in sorted(self.logs.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)


def _rotated(runs: Sequence[str], by: int) -> list[str]:
    return [runs[(i + by) % len(runs)] for i in range(len(runs))]


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in
                        enumerate(zip(row, widths, strict=True))))  # fmt: skip


def result_rows(rate: Rate, samples: dict[str, list[Sample]]) -> list[list[str]]:
    """The table's rows of one link: medians over the rounds; ``x torch`` is the median of
    the rounds' own ratios (round i's run against round i's torch)."""
    rows = []
    torch_rates = [s.steps_per_s for s in samples["torch"]]
    for run, got in samples.items():
        rates = [s.steps_per_s for s in got]
        ratios = [s / t for s, t in zip(rates, torch_rates, strict=True)]
        wire = statistics.median(s.wire_bytes for s in got)
        busiest = statistics.median(s.busiest_bytes * s.steps_per_s for s in got)
        payloads = [s.payload_bytes for s in got if s.payload_bytes is not None]
        rows.append(
            [
                rate.label,
                "torch (float32)" if run == "torch" else f"pipesvc {run}",
                f"{statistics.median(rates):.2f}",
                f"{min(rates):.2f}-{max(rates):.2f}",
                f"{statistics.median(ratios):.2f}",
                f"{wire / 1e6:.2f}",
                f"{statistics.median(payloads) / 1e6:.2f}" if payloads else "n/a",
                f"{8 * busiest / rate.bits_per_s:.2f}" if rate.bits_per_s else "n/a",
            ]
        )
    return rows


def run_bench(args: argparse.Namespace, rates: list[Rate]) -> None:
    with tempfile.TemporaryDirectory(prefix="pslinks-") as tmp:
        bench = Bench(args, Path(tmp))
        failed = True
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
        try:
            bench.build_hosts()
            started = time.monotonic()
            ready = bench.start_pipesvc()
            print(
                f"hosts {', '.join(bench.topo.netns.values())}; pipesvc stages at "
                f"{ready['plans']} (shared memory: none), ready in "
                f"{time.monotonic() - started:.0f} s",
                flush=True,
            )
            sanity = [["link", "tbf burst", "tbf latency", "raw TCP Mbit/s", "x rate"]]
            table = [
                ["link", "run", "steps/s", "range", "x torch", "wire MB/step",
                 "payload MB/step", "link busy"]
            ]  # fmt: skip
            for rate in rates:
                bench.shape(rate)
                mbit = bench.tcp_check(rate)
                sanity.append(
                    [
                        rate.label,
                        f"{rate.burst_bytes}" if rate.bits_per_s else "-",
                        TBF_LATENCY if rate.bits_per_s else "-",
                        f"{mbit:.0f}",
                        f"{mbit * 1e6 / rate.bits_per_s:.2f}" if rate.bits_per_s else "-",
                    ]
                )
                print(f"{rate.label}: raw TCP {mbit:.0f} Mbit/s", flush=True)
                runs = ("torch", *bench.runs)
                samples: dict[str, list[Sample]] = {run: [] for run in runs}
                for round_index in range(args.rounds):
                    for run in _rotated(runs, round_index):
                        sample = (
                            bench.torch_round(args.steps)
                            if run == "torch"
                            else bench.pipesvc_round(run, args.steps)
                        )
                        samples[run].append(sample)
                        print(
                            f"  round {round_index + 1} {run}: {sample.steps_per_s:.2f} steps/s, "
                            f"{sample.wire_bytes / 1e6:.2f} MB/step on the link",
                            flush=True,
                        )
                table += result_rows(rate, samples)
            failed = False
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop cleanup
            try:
                bench.close_client()
                if failed:
                    bench.print_logs()
                bench.procs.stop()
            finally:
                bench.remove_hosts()
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, previous)
    print(
        f"\nThe shaped link (tc tbf on both ends; burst in bytes, 1 ms of the rate, at least "
        f"{MIN_BURST_BYTES // 1024} KiB), checked by one raw TCP stream a -> b:\n"
    )
    _print_table(sanity)
    print(
        f"\nTraining across it: 8 x (Linear(256, 256) + ReLU), batch 4096 in 8 micro-batches, "
        f"MSE, SGD, 2 stages ({args.schedule}), one per host; {args.rounds} interleaved "
        f"round(s) of 1 (pipesvc) or 3 (torch) warm-up and {args.steps} timed steps "
        f"(pipesvc's {'through job.train' if args.train else 'a train_step loop'}); medians. "
        f"float32 activations and gradients are 8.39 MB per step (4.19 MB in bfloat16, "
        f"2.23 MB in int8 and 1.18 MB in int4, scales included).\n"
    )
    _print_table(table)
    losses = ", ".join(f"{k} {v:.5f}" for k, v in bench.first_loss.items())
    print(f"\nstep-1 loss (same weights and batch): {losses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 3 timed steps")
    parser.add_argument("--rates", default=DEFAULT_RATES, help="comma-separated tc rates, or none")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    parser.add_argument(
        "--train",
        action="store_true",
        help="time pipesvc's steps through job.train (one stream) rather than a train_step loop",
    )
    parser.add_argument(
        "--codecs", default=",".join(CODECS), help=f"pipesvc's rows, of {', '.join(CODECS)}"
    )
    hidden = argparse.SUPPRESS
    parser.add_argument("--client", help=hidden)
    parser.add_argument("--counters", help=hidden)
    parser.add_argument("--torch-rank", type=int, help=hidden)
    parser.add_argument("--address", help=hidden)
    parser.add_argument("--tcp-sink", help=hidden)
    parser.add_argument("--tcp-source", help=hidden)
    parser.add_argument("--bytes", type=int, help=hidden)
    args = parser.parse_args()
    if args.client:
        pipesvc_client(args.client, args.schedule, args.counters, args.codecs.split(","))
    elif args.torch_rank is not None:
        torch_rank(args.torch_rank, args.address, args.schedule, args.steps, args.counters)
    elif args.tcp_sink:
        tcp_sink(args.tcp_sink, args.bytes)
    elif args.tcp_source:
        tcp_source(args.tcp_source, args.bytes)
    else:
        if args.quick:
            args.rounds, args.steps = 1, 3
        unknown = [c for c in args.codecs.split(",") if c not in CODECS]
        if unknown:
            parser.error(f"unknown codec row {unknown[0]!r}; expected some of {', '.join(CODECS)}")
        rates = [Rate.parse(text) for text in args.rates.split(",")]
        reason = why_not_runnable()
        if reason:
            sys.exit(f"bench/links.py {reason}")
        try:
            run_bench(args, rates)
        except KeyboardInterrupt:
            sys.exit("interrupted (hosts and processes removed)")


if __name__ == "__main__":
    main()
