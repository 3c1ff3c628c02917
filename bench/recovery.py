"""What a fault costs: detection and recovery time per fault kind, and what checkpoints cost.

One job throughout: 8 x (Linear(1024, 1024) + ReLU) (``bench-mlp``), batch 64 in 8
micro-batches, 1F1B, MSE, SGD with momentum (so a checkpoint holds weights and optimizer
state), on ``LocalCluster(threads_per_stage=1)``: a coordinator, 2 stages and a spare.

- Faults: one fresh cluster per kind; 12 steps, checkpoint every 5 steps, the fault in step 7
  on rank 1 (in step 10's checkpoint for the checkpoint kind). Either the stage fails itself
  (the hidden ``--fault-kill WHEN[-ACTION]:STEP:RANK:MARKER`` flag) or the benchmark
  SIGSTOPs / SIGKILLs its pid, or hangs a TCP proxy in front of it.
- Fault time: the stage's own "fault injection" log line, or the wall clock when the
  benchmark acted. Detection: the coordinator's "recovering at step" line minus the fault
  time. Recovery: the coordinator's "recovered in X s" (new plan, restore, replay).
- Checkpoints: the same job on one cluster with ``checkpoint_every`` 0, 5 and 1.
- Leaks: the downstream stage SIGKILLed 10 times (a fresh spare each time); the surviving
  stage's threads, open fds and RSS after each recovery.

Usage: ``python bench/recovery.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

import pipesvc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # bench.bench_models, tests.support.faults
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
)  # for the stage processes, which import bench.bench_models

from tests.support.faults import TcpProxy, free_port, stage_pid  # noqa: E402

BATCH, NUM_MICROBATCHES, CHECKPOINT_EVERY = 64, 8, 5
OPTIMIZER = {"name": "sgd", "lr": 1e-3, "momentum": 0.9}
FAULT_STEP, CHECKPOINT_FAULT_STEP, NUM_STEPS, RANK = 7, 10, 12, 1
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
RECOVERING = re.compile(r"job (\S+): recovering at step (\d+) without (.*) \(cause: (.*)\)$")
RECOVERED = re.compile(r"job (\S+): recovered in ([\d.]+) s")
MISSED = re.compile(r"missed a health check \((\d+) in a row\)")
HEALTH_FAILURES = 2
"""The coordinator's default ``--health-failures``: the miss that declares a stage lost."""
CHECKPOINTED = re.compile(r"job (\S+): checkpoint at step (\d+) in ([\d.]+) s")


@dataclass(frozen=True)
class Fault:
    """One fault kind: a ``--fault-kill`` flag, or an action of the benchmark's own."""

    name: str
    flag: str = ""
    """WHEN[-ACTION]:STEP (rank and marker are added)."""
    action: str = ""
    """sigkill (before the step), sigstop (mid-step) or hang (the proxy, before the step)."""

    @property
    def step(self) -> int:
        return int(self.flag.split(":")[1]) if self.flag else FAULT_STEP


FAULTS = [
    Fault("kill at forward", flag=f"forward:{FAULT_STEP}"),
    Fault("kill at backward", flag=f"backward:{FAULT_STEP}"),
    Fault("kill at commit", flag=f"commit:{FAULT_STEP}"),
    Fault("kill in checkpoint", flag=f"checkpoint:{CHECKPOINT_FAULT_STEP}"),
    Fault("SIGSTOP at commit", flag=f"commit-stop:{FAULT_STEP}"),
    Fault("SIGSTOP mid-step", action="sigstop"),
    Fault("SIGKILL between steps", action="sigkill"),
    Fault("link hang (proxy)", action="hang"),
]


@dataclass
class Outcome:
    """One training run: client-timed steps, and what the coordinator logged."""

    step_seconds: list[float] = field(default_factory=list)
    recoveries_after: list[int] = field(default_factory=list)
    fault_time: float | None = None
    lost_time: float | None = None
    """When the health watchdog declared the stage lost (faults no stream reported)."""
    detected_time: float | None = None
    recovery_s: float | None = None
    cause: str = ""
    checkpoint_s: dict[int, float] = field(default_factory=dict)
    note: str = ""


def _log_time(line: str) -> float | None:
    match = LOG_TIME.match(line)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _read_logs(log_dir: Path, job_id: str, outcome: Outcome) -> None:
    """Fills the fault's, detection's and checkpoints' times in from the cluster's logs."""
    for path in sorted(log_dir.glob("stage-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "fault injection:" in line and outcome.fault_time is None:
                outcome.fault_time = _log_time(line)
    for line in (log_dir / "coordinator.log").read_text(errors="replace").splitlines():
        message = line.split("] ", 1)[-1]
        missed = MISSED.search(message)
        if missed and int(missed.group(1)) >= HEALTH_FAILURES and outcome.lost_time is None:
            outcome.lost_time = _log_time(line)
        elif (m := RECOVERING.search(message)) and m.group(1) == job_id:
            if outcome.detected_time is None:
                outcome.detected_time = _log_time(line)
                outcome.cause = m.group(4)
        elif (m := RECOVERED.search(message)) and m.group(1) == job_id:
            if outcome.recovery_s is None:
                outcome.recovery_s = float(m.group(2))
        elif (m := CHECKPOINTED.search(message)) and m.group(1) == job_id:
            outcome.checkpoint_s.setdefault(int(m.group(2)), float(m.group(3)))


def _create(client: pipesvc.Client, width: int, checkpoint_every: int) -> pipesvc.Job:
    return client.create_job(
        model="bench-mlp",
        model_args={"width": width, "depth": 8},
        seed=0,
        num_stages=2,
        num_microbatches=NUM_MICROBATCHES,
        schedule="1f1b",
        loss="mse",
        optimizer=OPTIMIZER,
        checkpoint_every=checkpoint_every,
        partition="uniform",
    )


def _batch(width: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)


def _train(
    job: pipesvc.Job, width: int, num_steps: int, before: Callable[[int], None], out: Outcome
) -> None:
    """Trains ``num_steps`` steps, calling ``before(step)`` ahead of each (1-based)."""
    for step in range(1, num_steps + 1):
        x, y = _batch(width, step)
        before(step)
        started = time.monotonic()
        job.train_step(x, y)
        out.step_seconds.append(time.monotonic() - started)
        out.recoveries_after.append(job.refresh().recoveries)


def _plain_median(seconds: list[float], skip: set[int]) -> float:
    """Median of steps 2.. (step 1 warms up) other than the 1-based steps in ``skip``."""
    kept = [s for i, s in enumerate(seconds, 1) if i > 1 and i not in skip]
    return statistics.median(kept) if kept else float("nan")


class _External:
    """The benchmark's own fault actions on rank 1 of the job (by pid, or its proxy)."""

    def __init__(self, fault: Fault, job: pipesvc.Job, proxy: TcpProxy | None, out: Outcome):
        self.fault, self.job, self.proxy, self.out = fault, job, proxy, out
        self.stopped: int | None = None
        if "-stop" in fault.flag:  # the stage stops itself: continue it at the end
            self.stopped = stage_pid(job.plan[RANK].address)
        self.timer: threading.Timer | None = None

    def _signal(self, signum: int) -> None:
        pid = stage_pid(self.job.plan[RANK].address)
        self.out.fault_time = time.time()
        os.kill(pid, signum)
        if signum == signal.SIGSTOP:
            self.stopped = pid

    def before(self, step: int) -> None:
        if step != FAULT_STEP:
            return
        if self.fault.action == "sigkill":
            self._signal(signal.SIGKILL)
        elif self.fault.action == "hang" and self.proxy is not None:
            self.out.fault_time = time.time()
            self.proxy.hang()
        elif self.fault.action == "sigstop":
            # Halfway through a typical step: inside rank 1's forwards or backwards.
            delay_s = _plain_median(self.out.step_seconds, set()) / 2
            self.timer = threading.Timer(delay_s, self._signal, (signal.SIGSTOP,))
            self.timer.start()

    def undo(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.stopped is not None:
            os.kill(self.stopped, signal.SIGCONT)


def run_fault(fault: Fault, width: int, tmp: Path) -> Outcome:
    """Trains the job on a fresh 3-stage cluster with ``fault``; returns what it cost."""
    out = Outcome()
    stage_args = ["--fault-kill", f"{fault.flag}:{RANK}:{tmp / fault.name}"] if fault.flag else []
    proxy = None
    if fault.action == "hang":
        stage_args = ["--shm-bytes", "0"]  # else activations bypass the proxy
    num_stages = 1 if fault.action == "hang" else 3
    with pipesvc.LocalCluster(
        num_stages=num_stages,
        models=["bench.bench_models"],
        threads_per_stage=1,
        stage_args=stage_args,
    ) as cluster:
        if fault.action == "hang":
            real = free_port()
            proxy = TcpProxy(real)
            advertised = f"127.0.0.1:{proxy.port}"
            cluster.add_stage(["--listen", f"127.0.0.1:{real}", "--advertise", advertised])
            cluster.add_stage()  # the spare
        with cluster.connect() as client:
            job = _create(client, width, CHECKPOINT_EVERY)
            if proxy is not None and job.plan[RANK].address != advertised:
                out.note = "the proxied stage is not rank 1: no fault"
            external = _External(fault, job, proxy, out)
            try:
                _train(job, width, NUM_STEPS, external.before, out)
            finally:
                external.undo()
                if proxy is not None:
                    proxy.close()
            job.close()
        _read_logs(cluster.log_dir, job.id, out)
    return out


def run_checkpoints(width: int, everies: tuple[int, ...]) -> dict[int, Outcome]:
    """The same job with each ``checkpoint_every`` on one cluster (2 stages, no fault)."""
    results = {}
    with (
        pipesvc.LocalCluster(
            num_stages=2, models=["bench.bench_models"], threads_per_stage=1
        ) as cluster,
        cluster.connect() as client,
    ):
        for every in everies:
            out = Outcome()
            job = _create(client, width, every)
            _train(job, width, NUM_STEPS, lambda step: None, out)
            job.close()
            _read_logs(cluster.log_dir, job.id, out)
            results[every] = out
    return results


def _usage(pid: int) -> tuple[int, int, int]:
    """(threads, open fds, resident bytes) of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split(":")[1].split() for line in status if ":" in line}
    return int(fields["Threads"][0]), len(os.listdir(f"/proc/{pid}/fd")), int(fields["VmRSS"][0])


def run_leaks(width: int, recoveries: int) -> list[list[str]]:
    """Rank 1 SIGKILLed ``recoveries`` times; rank 0's usage and the faulty step per kill."""
    rows = [["recovery", "threads", "fds", "RSS MiB", "faulty step s", "recovered in s"]]
    with (
        pipesvc.LocalCluster(
            num_stages=3, models=["bench.bench_models"], threads_per_stage=1
        ) as cluster,
        cluster.connect() as client,
    ):
        job = _create(client, width, CHECKPOINT_EVERY)
        survivor = stage_pid(job.plan[0].address)
        out = Outcome()
        _train(job, width, 2, lambda step: None, out)
        rows.append(["before", *_usage_cells(survivor), "", ""])
        for number in range(1, recoveries + 1):
            os.kill(stage_pid(job.plan[RANK].address), signal.SIGKILL)
            started = time.monotonic()
            job.train_step(*_batch(width, number))
            faulty_s = time.monotonic() - started
            job.train_step(*_batch(width, number + 1000))
            if stage_pid(job.refresh().plan[0].address) != survivor:
                rows.append([str(number), "rank 0 changed", "", "", "", ""])
                break
            cluster.add_stage()  # the next spare
            rows.append([str(number), *_usage_cells(survivor), f"{faulty_s:.2f}", ""])
        text = (cluster.log_dir / "coordinator.log").read_text(errors="replace")
        times = [m.group(2) for m in RECOVERED.finditer(text) if m.group(1) == job.id]
        for row, took in zip(rows[2:], times, strict=False):
            row[5] = took
        job.close()
    return rows


def _usage_cells(pid: int) -> list[str]:
    threads, fds, rss_kib = _usage(pid)
    return [str(threads), str(fds), f"{rss_kib / 1024:.1f}"]


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _fault_row(fault: Fault, out: Outcome) -> tuple[list[str], str]:
    """A row of the fault table, and the cause the coordinator logged."""
    increased = [i for i, n in enumerate(out.recoveries_after, 1) if n > 0]
    faulty = increased[0] if increased else fault.step
    checkpoints = {s for s in range(1, NUM_STEPS + 1) if s % CHECKPOINT_EVERY == 0}
    median = _plain_median(out.step_seconds, checkpoints | {faulty})
    faulty_s = out.step_seconds[faulty - 1]
    detect = lost = None
    if out.fault_time is not None and out.detected_time is not None:
        detect = out.detected_time - out.fault_time
    if out.fault_time is not None and out.lost_time is not None:
        lost = out.lost_time - out.fault_time
    row = [
        fault.name,
        str(faulty),
        str(out.recoveries_after[-1]),
        f"{median * 1e3:.0f}",
        f"{faulty_s:.2f}",
        f"{faulty_s / median:.0f}",
        _fmt(lost),
        _fmt(detect),
        _fmt(out.recovery_s),
    ]
    cause = out.cause if len(out.cause) < 160 else out.cause[:157] + "..."
    return row, f"{fault.name}: {out.note or cause or 'no recovery logged'}"


def _checkpoint_rows(results: dict[int, Outcome]) -> list[list[str]]:
    rows = [["checkpoint_every", "median step ms", "ckpt step ms", "ckpt save s", "mean step ms"]]
    rows[0].append("mean/off")
    base = statistics.mean(results[0].step_seconds[1:])
    for every, out in results.items():
        ckpt_steps = {s for s in range(2, NUM_STEPS + 1) if every and s % every == 0}
        plain = _plain_median(out.step_seconds, ckpt_steps)
        ckpt = [out.step_seconds[s - 1] for s in ckpt_steps]
        saves = [out.checkpoint_s[s] for s in ckpt_steps if s in out.checkpoint_s]
        mean = statistics.mean(out.step_seconds[1:])
        rows.append(
            [
                str(every) if every else "0 (off)",
                "n/a" if plain != plain else f"{plain * 1e3:.0f}",
                f"{statistics.median(ckpt) * 1e3:.0f}" if ckpt else "n/a",
                f"{statistics.median(saves):.2f}" if saves else "n/a",
                f"{mean * 1e3:.0f}",
                f"{mean / base:.2f}",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="width 256, 3 fault kinds, 3 recoveries for leaks"
    )
    args = parser.parse_args()
    width = 256 if args.quick else 1024
    faults = FAULTS[::3] if args.quick else FAULTS
    started = time.monotonic()
    load = os.getloadavg()

    header = ["fault", "step", "recoveries", "median step ms", "faulty step s"]
    rows = [[*header, "faulty/median", "lost s", "detect s", "recover s"]]
    causes = []
    with tempfile.TemporaryDirectory(prefix="pipesvc-bench-recovery-") as tmp:
        for fault in faults:
            case_started = time.monotonic()
            row, cause = _fault_row(fault, run_fault(fault, width, Path(tmp)))
            took_s = time.monotonic() - case_started
            print(f"{fault.name}: {took_s:.0f} s", file=sys.stderr, flush=True)
            rows.append(row)
            causes.append(cause)
    checkpoints = run_checkpoints(width, (0, CHECKPOINT_EVERY, 1))
    leaks = run_leaks(width, 3 if args.quick else 10)
    print(
        f"\nJob: 8 x (Linear({width}, {width}) + ReLU), batch {BATCH} in {NUM_MICROBATCHES} "
        f"micro-batches, 1F1B, MSE, SGD momentum 0.9; 2 stages + 1 spare, 1 thread each;\n"
        f"{NUM_STEPS} steps, checkpoint every {CHECKPOINT_EVERY}, fault on rank {RANK} in step "
        f"{FAULT_STEP} (checkpoint kind: step {CHECKPOINT_FAULT_STEP}'s checkpoint). "
        f"{os.cpu_count()} CPU cores; load average at start "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}.\n"
        "median: steps 2.. without the fault and checkpoints; lost: fault to the health "
        "watchdog's last missed check\n(n/a: a broken stream reported it); detect: fault to "
        "the coordinator's 'recovering' line; recover: its 'recovered in'.\n"
    )
    _print_table(rows)
    print("\nWhat the coordinator saw (cause of the recovery):")
    for cause in causes:
        print(f"  {cause}")
    print(f"\nCheckpoints, same job, no fault, {NUM_STEPS} steps (mean over steps 2..):\n")
    _print_table(_checkpoint_rows(checkpoints))
    print("\nSurviving rank 0 across recoveries (rank 1 SIGKILLed between steps, new spare):\n")
    _print_table(leaks)
    print(f"\ntotal {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
