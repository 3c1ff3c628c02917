"""Per-step overhead on small models: pipesvc vs torch.distributed.pipelining, and where a
pipesvc step's time goes.

Models (so small that a step is mostly overhead), batch 64 in 4 micro-batches, MSE, SGD
(lr 1e-3), split uniformly over 2 and 4 stages, GPipe and 1F1B, one torch thread per stage:

- tiny: 4 x (Linear(32, 32) + ReLU) (``bench-mlp`` with width 32, depth 4).
- mlp: the built-in ``mlp`` with its defaults (16 -> 32 -> 32 -> 32 -> 8: three Linear + ReLU
  blocks and a Linear).

- torch: ``bench/pipeline.py``'s baseline (``PipelineStage`` + ``ScheduleGPipe`` /
  ``Schedule1F1B`` over gloo, one process per stage), given these models and batches.
- pipesvc: ``LocalCluster(num_stages=N, threads_per_stage=1)``; ``job.train_step`` timed from
  the client, each step on its own, and ``job.train`` (pipelined steps over one stream), timed
  from the first loss of each of its streams to its last (a stream per chunk is this script's
  doing; a training job keeps one), the two taking turns on the same job
  in chunks of ``CHUNK`` steps so that both see the same load; with checkpoints off
  (``checkpoint_every=0``), at the default cadence (``checkpoint_every=None``: set by cost,
  see pipesvc.core.cadence; the configuration the step-path goals name) and every 10 steps.

The breakdown of a pipesvc ``train_step`` (ms per step, mean over its timed steps) lines up three
clocks of one host (``time.time_ns()``):

- own figures: the client's call (``client``); the coordinator's ``pipesvc_step_seconds``
  histogram (``coord``: its lock held, from readiness check to the step's database write,
  served with ``--metrics-port``); its log's "checkpoint at step N in X s" (``ckpt log``: the
  part on a step's path, reading the stages' state; the files are written in the background);
  the stages' recorded spans (``job.timelines()``): the step's
  ``window`` (first action on any stage to last), and ``compute``, ``wait`` and ``send``
  summed over the stages.
- derived: ``before`` = first stage action - client call start (client encode, gRPC, the
  coordinator's decode, split, micro-batch encode, RunStep dispatch, the stage's decode and
  its commit of the previous step);
  ``after`` = client call end - last stage action (RunStep replies, waiting for the step log,
  the database write, the step's log line, the reply; the step's commit rides on the next
  step's RunStep, so its optimizer step is in that step's ``before``); ``outside coord`` =
  client - coord (what the coordinator's lock does not cover, checkpoints included).
- measured here, not in the coordinator: ``steplog*`` (``StepLog.write`` of this batch, which
  appends it to a segment file and syncs it) and ``db*`` (``StateDB.put_job`` of a job
  record), each timed in this process on the cluster's file system.

Besides steps/s, both sides report CPU per step (``cpu ms``), which a shared machine's load
changes much less than wall time: torch's ranks each time their own CPU (``time.process_time``)
over the timed steps, summed; pipesvc's ``job.train`` steps count every process of the cluster
(``/proc/<pid>/stat``: coordinator and stages) plus this one (the client).

With ``--rounds N`` every row is measured N times (per stage count: pipesvc's jobs on one
cluster, then torch), and a last table gives each ratio to torch as the median and range of
the N rounds' ratios, each against torch in its own round. On a shared machine torch's own
rate for a row can move 2x between two runs minutes apart, so one round's ratio says little;
the detailed tables are round 1's.

With ``--beside``, torch is timed a second time beside two processes that take as much CPU
as pipesvc's coordinator and client took per ``job.train`` step (default cadence), each as a
duty cycle of 100 µs bursts (``_load``). On a host with fewer cores than pipesvc has processes,
this is what its extra processes cost: torch's rate beside them says how fast its ranks run
when they share the cores as pipesvc's stages do. It is an approximation (a duty cycle is not
the coordinator's pattern of wake-ups), printed as a table of its own.

With ``--clip C`` both sides clip the global gradient norm to ``C``: pipesvc jobs get
``clip_grad_norm=C``, and each torch rank sums its squared norm with the others' in one
all-reduce before its optimizer step (as torchtitan clips a pipeline).

Usage: ``python bench/overhead.py [--quick] [--models tiny,mlp] [--clip C] [--rounds N]
[--beside]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # spawned children inherit sys.path

import pipesvc  # noqa: E402
from bench import pipeline as base  # noqa: E402
from pipesvc.coordinator.database import JobRecord, StateDB  # noqa: E402
from pipesvc.coordinator.step_log import LoggedBatch, StepLog  # noqa: E402
from pipesvc.core.planning.partition import uniform  # noqa: E402
from pipesvc.observe.trace import StageTimeline  # noqa: E402

BATCH, NUM_MICROBATCHES, LR = 64, 4, 1e-3
CLIP: float | None = None
"""``--clip``: the global gradient norm both sides clip to (None: no clipping)."""
WARMUP_STEPS = 5
SCHEDULES = ("gpipe", "1f1b")
"""The schedules timed (``pipeline.py`` has more; torch's run as the same names)."""
CHUNK = 25
"""``train_step`` and ``job.train`` take turns in chunks of this many steps."""
CADENCES: tuple[int | None, ...] = (0, None, 10)
"""``checkpoint_every`` of each timed job: off, the default (cost-set) cadence, every 10."""
LOAD_BURST_S = 100e-6
"""``--beside``: the length of each burst of a load process's duty cycle."""
TINY = base.Workload("tiny", "bench-mlp", {"width": 32, "depth": 4}, "mse", 4)
MLP = base.Workload("mlp", "mlp", {}, "mse", 4)
WORKLOADS = {w.name: w for w in (TINY, MLP)}
SIZES = {"tiny": (32, 32), "mlp": (16, 8)}
"""Input and output features of each model."""


def _batch(w: base.Workload) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    features_in, features_out = SIZES[w.name]
    return torch.randn(BATCH, features_in, generator=gen), torch.randn(
        BATCH, features_out, generator=gen
    )


class _CpuMark:
    """``_time_steps``' mark in a torch rank: puts the rank's CPU seconds (all its threads)
    over the timed window on the queue as ``cpu<rank>``."""

    _start: float | None

    def __init__(self, q: Any, rank: int) -> None:
        self._q, self._rank, self._start = q, rank, None

    def __call__(self) -> None:
        if self._start is None:
            self._start = time.process_time()
        else:
            self._q.put((f"cpu{self._rank}", time.process_time() - self._start))


def _torch_child(
    q: Any,
    clip: float | None,
    workload: str,
    rank: int,
    world: int,
    address: str,
    schedule: str,
    num_steps: int,
) -> None:
    """``bench/pipeline.py``'s torch stage, pointed at this script's models and batch, clipping
    to ``clip`` (None: not), reporting its CPU time (``_CpuMark``)."""
    base.WORKLOADS = WORKLOADS
    base.NUM_MICROBATCHES = NUM_MICROBATCHES
    base.WARMUP_STEPS = WARMUP_STEPS
    base.LR = LR
    base.CLIP = clip
    base._batch = _batch
    base._torch_stage(q, workload, rank, world, address, schedule, num_steps, _CpuMark(q, rank))


@dataclass(frozen=True)
class TorchRun:
    """Steps/s of torch.distributed.pipelining and its CPU ms per step, every rank summed."""

    rate: float
    cpu_ms: float


def torch_steps_per_s(
    w: base.Workload, schedule: str, world: int, num_steps: int, beside: tuple[float, ...] = ()
) -> TorchRun | str:
    """Steps/s and CPU of torch.distributed.pipelining, or why it failed; ``beside``: the
    share of one core each load process takes meanwhile (``_load``; none by default)."""
    address = base._free_address()
    targets = [
        (_torch_child, (CLIP, w.name, r, world, address, schedule, num_steps)) for r in range(world)
    ]
    cpus = tuple(f"cpu{r}" for r in range(world))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    loads = [ctx.Process(target=_load, args=(share, stop), daemon=True) for share in beside]
    for load in loads:
        load.start()
    try:
        result = base._run_children(targets, expect=("seconds", "loss", *cpus))
    finally:
        stop.set()
        for load in loads:
            load.join(timeout=5)
            if load.is_alive():
                load.terminate()
    if isinstance(result, str):
        return result
    cpu_ms = sum(result[c] for c in cpus) * 1e3 / num_steps
    return TorchRun(num_steps / result["seconds"], cpu_ms)


def _load(share: float, stop: Any) -> None:
    """Takes ``share`` of one core until ``stop`` is set: ``LOAD_BURST_S`` of spinning, then a
    sleep, as a server handling one message after another does (``--beside``)."""
    pause = LOAD_BURST_S * (1 - share) / share
    while not stop.is_set():
        began = time.perf_counter()
        while time.perf_counter() - began < LOAD_BURST_S:
            pass
        time.sleep(pause)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system, every thread) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cluster_cpu_s(cluster: Any) -> dict[str, float]:
    """CPU seconds used so far by the cluster's coordinator, its stages (summed) and this
    process (the client)."""
    coordinator, *stages = cluster.pids
    return {
        "coordinator": _cpu_s(coordinator),
        "stages": sum(_cpu_s(pid) for pid in stages),
        "client": time.process_time(),
    }


@dataclass(frozen=True)
class PipesvcRun:
    """One job's timed steps: per-step client times (ms) of ``train_step`` and the
    breakdown's columns; ``job.train``'s steps/s and ms between losses."""

    step_ms: list[float]
    breakdown: dict[str, float]
    train_rate: float
    train_ms: list[float]
    train_cpu: dict[str, float]
    """CPU ms per ``job.train`` step of the coordinator, the stages (summed) and the client."""

    @property
    def step_rate(self) -> float:
        """``train_step``'s steps/s: one over its mean time per step."""
        return 1e3 / statistics.fmean(self.step_ms)

    @property
    def train_cpu_ms(self) -> float:
        """CPU ms per ``job.train`` step, the client and every pipesvc process summed."""
        return sum(self.train_cpu.values())


def _coordinator_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the coordinator's ``pipesvc_step_seconds`` histogram."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = dict(re.findall(r"^pipesvc_step_seconds_(sum|count) (\S+)$", text, re.MULTILINE))
    return float(found["sum"]), float(found["count"])


def _checkpoint_log_s(log: Path, job_id: str, steps: range) -> float:
    """Seconds the coordinator logged for this job's checkpoints at ``steps``."""
    pattern = re.compile(rf"job {re.escape(job_id)}: checkpoint at step (\d+) in ([\d.]+) s")
    found = (pattern.search(line) for line in log.read_text().splitlines())
    return sum(float(m[2]) for m in found if m and int(m[1]) in steps)


def _spans(
    timelines: list[StageTimeline], steps: range, only: set[int] | None = None
) -> dict[str, float]:
    """Per-step means (ms) of the stages' window and their summed compute, wait and send,
    over ``steps`` (those in ``only``, if given)."""
    totals = dict.fromkeys(("window", "compute", "wait", "send"), 0.0)
    chosen = [s for s in steps if only is None or s in only]
    for step in chosen:
        events = [e for t in timelines for e in t.events if e.step == step]
        totals["window"] += max(e.end_ns for e in events) - min(e.start_ns for e in events)
        for e in events:
            kind = "compute" if e.name in ("forward", "backward", "weight") else e.name
            totals[kind] += e.end_ns - e.start_ns
    return {k: v / 1e6 / len(chosen) for k, v in totals.items()}


def time_job(job: pipesvc.Job, w: base.Workload, num_steps: int, cluster: Any) -> PipesvcRun:
    """Warms up, then times ``num_steps`` steps sent one by one with ``train_step`` and
    ``num_steps`` through ``job.train``, in alternating chunks of ``CHUNK`` (so that both see
    the same load), and gathers the breakdown of the ``train_step`` ones."""
    x, y = _batch(w)
    for _ in range(WARMUP_STEPS):
        job.train_step(x, y)
    list(job.train([(x, y)] * WARMUP_STEPS))
    chunk = min(CHUNK, num_steps)
    calls: dict[int, tuple[int, int]] = {}  # train_step's step -> its call's start and end
    coord_s, coord_n = 0.0, 0.0
    train_s, train_ms = 0.0, []
    train_cpu_s = dict.fromkeys(("coordinator", "stages", "client"), 0.0)
    for _ in range(max(1, num_steps // chunk)):
        before_sum, before_count = _coordinator_seconds(cluster.metrics_url)
        for _ in range(chunk):
            start = time.time_ns()
            job.train_step(x, y)
            calls[job.step] = (start, time.time_ns())
        after_sum, after_count = _coordinator_seconds(cluster.metrics_url)
        coord_s, coord_n = coord_s + after_sum - before_sum, coord_n + after_count - before_count
        # Timed from each stream's first loss to its last: opening a stream per chunk (so
        # that train_step can take its turn) is this script's doing, not a training job's,
        # and torch's timed steps follow its warm-up steps without a break too.
        stream = job.train([(x, y)] * (chunk + 1))
        next(stream)
        cpu_before = _cluster_cpu_s(cluster)
        began = last = time.perf_counter()
        for _ in stream:
            now = time.perf_counter()
            train_ms.append((now - last) * 1e3)
            last = now
        train_s += last - began
        for part, seconds in _cluster_cpu_s(cluster).items():
            train_cpu_s[part] += seconds - cpu_before[part]
    steps = sorted(calls)
    timelines = job.timelines()
    windows = {}
    for step in steps:
        events = [e for t in timelines for e in t.events if e.step == step]
        windows[step] = (min(e.start_ns for e in events), max(e.end_ns for e in events))
    n = len(steps)
    client_ms = [(calls[s][1] - calls[s][0]) / 1e6 for s in steps]
    before = sum(windows[s][0] - calls[s][0] for s in steps) / 1e6 / n
    after = sum(calls[s][1] - windows[s][1] for s in steps) / 1e6 / n
    coord_ms = coord_s * 1e3 / coord_n
    ckpt_ms = _checkpoint_log_s(cluster.log_dir / "coordinator.log", job.id, range(1, job.step + 1))
    ckpt_ms = ckpt_ms * 1e3 / job.step  # checkpoints come with both kinds of step alike
    breakdown = {
        "client": statistics.fmean(client_ms),
        "coord": coord_ms,
        "outside coord": statistics.fmean(client_ms) - coord_ms,
        "ckpt log": ckpt_ms,
        "before": before,
        "after": after,
        **_spans(timelines, range(steps[0], steps[-1] + 1), only=set(steps)),
    }
    rate = len(train_ms) / train_s
    train_cpu = {part: s * 1e3 / len(train_ms) for part, s in train_cpu_s.items()}
    return PipesvcRun(client_ms, breakdown, rate, train_ms, train_cpu)


class _Cluster(pipesvc.LocalCluster):
    """A LocalCluster whose coordinator serves its metrics; ``metrics_url`` says where."""

    metrics_url = ""

    def start(self) -> _Cluster:
        super().start()
        log = (self.log_dir / "coordinator.log").read_text()
        url = re.search(r"serving Prometheus metrics on (\S+)", log)
        if url is None:
            raise RuntimeError(f"the coordinator did not log its metrics address:\n{log}")
        self.metrics_url = url[1]
        return self


def measure_pipesvc(
    num_stages: int, num_steps: int
) -> dict[tuple[str, str, int | None], PipesvcRun]:
    """``{(workload, schedule, checkpoint_every): run}`` on one cluster of ``num_stages``."""
    results = {}
    with _Cluster(
        num_stages=num_stages,
        models=["bench.bench_models"],
        threads_per_stage=1,
        coordinator_args=["--metrics-port", "0"],
    ) as cluster:
        client = cluster.connect()
        for w in WORKLOADS.values():
            for schedule in SCHEDULES:
                for every in CADENCES:
                    job = client.create_job(
                        model=w.model,
                        model_args=w.model_args,
                        num_stages=num_stages,
                        num_microbatches=NUM_MICROBATCHES,
                        schedule=schedule,
                        optimizer={"name": "sgd", "lr": LR},
                        loss=w.loss,
                        partition="uniform",
                        checkpoint_every=every,
                        clip_grad_norm=CLIP,
                    )
                    plan = [(s.start_layer, s.end_layer) for s in job.plan]
                    if plan != uniform(w.num_layers, num_stages):
                        raise RuntimeError(f"pipesvc planned {plan}; torch uses the uniform split")
                    results[w.name, schedule, every] = time_job(job, w, num_steps, cluster)
                    job.close()
        client.close()
    return results


def measure_storage(directory: Path, num_writes: int = 20) -> dict[str, float]:
    """ms per ``StepLog.write`` of each model's batch and per ``StateDB.put_job``, timed here."""
    found = {}
    for w in WORKLOADS.values():
        log = StepLog(directory / w.name)
        start = time.perf_counter()
        for step in range(1, num_writes + 1):
            log.write(step, LoggedBatch(*_batch(w)))
        found[f"steplog {w.name}"] = (time.perf_counter() - start) * 1e3 / num_writes
    db = StateDB(directory / "db")
    spec = {"model": "mlp", "model_args": {}, "optimizer": {"name": "sgd", "lr": LR}}
    plan = [{"start_layer": 0, "end_layer": 2, "rank": 0, "address": "127.0.0.1:1"}] * 2
    start = time.perf_counter()
    for step in range(num_writes):
        record = JobRecord(
            job_id="j",
            spec=spec,
            plan=plan,
            layers=b"x" * 2000,
            epoch=1,
            step=step,
            run_id=step,
            checkpoint_step=-1,
        )
        db.put_job(record)
    found["db"] = (time.perf_counter() - start) * 1e3 / num_writes
    db.close()
    return found


Round = tuple[
    dict[tuple[int, str, str, int | None], PipesvcRun], dict[tuple[int, str, str], TorchRun | str]
]
"""One round's measurements: pipesvc's runs by (stages, model, schedule, checkpoint_every),
torch's (or why it failed) by (stages, model, schedule)."""


def measure_round(num_steps: int) -> Round:
    """Every row once: per stage count, pipesvc's jobs on one cluster, then torch's."""
    ours: dict[tuple[int, str, str, int | None], PipesvcRun] = {}
    theirs: dict[tuple[int, str, str], TorchRun | str] = {}
    for p in base.STAGE_COUNTS:
        ours.update({(p, *key): run for key, run in measure_pipesvc(p, num_steps).items()})
        for w in WORKLOADS.values():
            for schedule in SCHEDULES:
                theirs[p, w.name, schedule] = torch_steps_per_s(w, schedule, p, num_steps)
    return ours, theirs


def _spread(values: list[float], digits: int = 2) -> str:
    """``median (min-max)`` of ``values``; n/a for none."""
    if not values:
        return "n/a"
    middle, low, high = statistics.median(values), min(values), max(values)
    return f"{middle:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def rounds_table(rounds: list[Round]) -> list[list[str]]:
    """Per row: torch's steps/s, and each cadence's ``train_step`` and ``job.train`` ratio to
    torch in the same round, as median (min-max) over the rounds that torch did not fail."""
    head = ["model", "schedule", "stages", "torch steps/s"]
    for label in map(_cadence, CADENCES):
        head += [f"train_step {label} /torch", f"train {label} /torch"]
    rows = [head]
    for p in base.STAGE_COUNTS:
        for w in WORKLOADS.values():
            for schedule in SCHEDULES:
                paired = [
                    (ours, t)
                    for ours, theirs in rounds
                    if isinstance(t := theirs[p, w.name, schedule], TorchRun)
                ]
                row = [w.name, schedule, str(p), _spread([t.rate for _, t in paired], 1)]
                for every in CADENCES:
                    runs = [(ours[p, w.name, schedule, every], t) for ours, t in paired]
                    steps = [r.step_rate / t.rate for r, t in runs]
                    train = [r.train_rate / t.rate for r, t in runs]
                    row += [_spread(steps), _spread(train)]
                rows.append(row)
    return rows


def _cadence(every: int | None) -> str:
    """A ``checkpoint_every``'s label in the tables."""
    return "default" if every is None else f"every {every}" if every else "off"


def _shares(run: PipesvcRun) -> tuple[float, float]:
    """The share of one core pipesvc's coordinator and client each took over ``run``'s
    ``job.train`` steps (at least 1%, at most all of it)."""
    step_ms = 1e3 / run.train_rate

    def share(part: str) -> float:
        return min(1.0, max(0.01, run.train_cpu[part] / step_ms))

    return share("coordinator"), share("client")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values`` by rank; NaN when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 timed steps instead of 200")
    parser.add_argument(
        "--models", default="tiny,mlp", help="comma-separated models to time (default: both)"
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=None,
        help="clip the global gradient norm to this, in pipesvc and torch alike (default: off)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure both sides this many times and add a table of each ratio's median and "
        "range (default: 1)",
    )
    parser.add_argument(
        "--beside",
        action="store_true",
        help="also time torch beside a load like pipesvc's coordinator and client",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    global CLIP
    CLIP = args.clip
    num_steps = 30 if args.quick else 200
    chosen = args.models.split(",")
    for name in set(WORKLOADS) - set(chosen):
        del WORKLOADS[name]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # for the stage processes, which import bench.bench_models
    rounds = [measure_round(num_steps) for _ in range(args.rounds)]
    ours, torch_runs = rounds[0]
    with tempfile.TemporaryDirectory(prefix="pipesvc-overhead-") as tmp:
        storage = measure_storage(Path(tmp))
    rate_rows = [["model", "schedule", "stages", "torch steps/s", "torch ms", "cpu ms"]]
    for label in map(_cadence, CADENCES):
        rate_rows[0] += [f"pipesvc ckpt {label} steps/s", "ms", "p50 ms", "p99 ms", "/torch"]
        rate_rows[0] += ["train steps/s", "ms", "p50 ms", "p99 ms", "/torch", "cpu ms", "/torch"]
    cols = ["client", "coord", "outside coord", "ckpt log", "before", "window", "after"]
    cols += ["compute", "wait", "send"]
    parts_rows = [["model", "schedule", "stages", "ckpt", *cols, "steplog*", "db*"]]
    beside_head = ["model", "schedule", "stages", "pipesvc cpu ms: coordinator", "stages"]
    beside_head += ["client", "load shares", "torch steps/s", "beside", "/torch"]
    beside_rows = [[*beside_head, "pipesvc train", "/beside"]]
    errors = {}
    for p in base.STAGE_COUNTS:
        for w in WORKLOADS.values():
            for schedule in SCHEDULES:
                theirs = torch_runs[p, w.name, schedule]
                if isinstance(theirs, str):
                    errors[f"{w.name}, {schedule} x {p}"] = theirs
                row = [w.name, schedule, str(p)]
                row += (
                    ["failed", "n/a", "n/a"]
                    if isinstance(theirs, str)
                    else [f"{theirs.rate:.1f}", f"{1e3 / theirs.rate:.2f}", f"{theirs.cpu_ms:.2f}"]
                )
                for every in CADENCES:
                    run = ours[p, w.name, schedule, every]
                    rate = run.step_rate
                    ratio = "n/a" if isinstance(theirs, str) else f"{rate / theirs.rate:.2f}"
                    quantiles = [f"{percentile(run.step_ms, q):.2f}" for q in (0.5, 0.99)]
                    row += [f"{rate:.1f}", f"{1e3 / rate:.2f}", *quantiles, ratio]
                    rate = run.train_rate
                    ratio = "n/a" if isinstance(theirs, str) else f"{rate / theirs.rate:.2f}"
                    quantiles = [f"{percentile(run.train_ms, q):.2f}" for q in (0.5, 0.99)]
                    row += [f"{rate:.1f}", f"{1e3 / rate:.2f}", *quantiles, ratio]
                    cpu = run.train_cpu_ms
                    cpu_ratio = "n/a" if isinstance(theirs, str) else f"{cpu / theirs.cpu_ms:.2f}"
                    row += [f"{cpu:.2f}", cpu_ratio]
                    cells = [f"{run.breakdown[c]:.2f}" for c in cols]
                    store = [f"{storage[f'steplog {w.name}']:.2f}", f"{storage['db']:.2f}"]
                    parts_rows.append([w.name, schedule, str(p), _cadence(every), *cells, *store])
                rate_rows.append(row)
                if args.beside and not isinstance(theirs, str):
                    run = ours[p, w.name, schedule, None]
                    row = [w.name, schedule, str(p)]
                    row += [f"{run.train_cpu[k]:.2f}" for k in ("coordinator", "stages", "client")]
                    shares = _shares(run)
                    loaded = torch_steps_per_s(w, schedule, p, num_steps, beside=shares)
                    row += ["/".join(f"{s:.2f}" for s in shares), f"{theirs.rate:.1f}"]
                    if isinstance(loaded, str):
                        errors[f"{w.name}, {schedule} x {p}, beside a load"] = loaded
                        row += ["failed", "n/a", f"{run.train_rate:.1f}", "n/a"]
                    else:
                        row += [f"{loaded.rate:.1f}", f"{loaded.rate / theirs.rate:.2f}"]
                        row += [f"{run.train_rate:.1f}", f"{run.train_rate / loaded.rate:.2f}"]
                    beside_rows.append(row)
    print(
        "\nSmall steps: tiny = 4 x (Linear(32, 32) + ReLU), mlp = built-in mlp (16 -> 32 x 3 "
        f"-> 8); batch {BATCH} in {NUM_MICROBATCHES} micro-batches, MSE, SGD;\n"
        f"{WARMUP_STEPS} warm-up + {num_steps} timed steps; 1 thread per stage process "
        "(pipesvc adds a coordinator); "
        f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f}.\n"
    )
    base._print_table(rate_rows)
    print(
        "\nWhere a pipesvc step goes, ms/step (mean). Own timestamps: client, coord (coordinator's"
        " step_seconds),\nckpt log (coordinator's log, amortised per step), window/compute/wait/"
        "send (stages' spans; compute, wait, send\nsummed over stages). Derived: before = first "
        "stage action - call start, after = call end - last stage action,\noutside coord = client"
        " - coord. * timed in this process on the same file system, not inside the coordinator.\n"
    )
    base._print_table(parts_rows)
    if args.beside:
        print(
            "\nTorch beside a load like pipesvc's coordinator and client (default cadence): "
            "their CPU per job.train step\nas a share of one core each (load shares), taken "
            "by two duty-cycle processes while torch runs again\n(beside). pipesvc train / "
            "beside compares pipesvc with torch sharing the cores as pipesvc's stages do.\n"
        )
        base._print_table(beside_rows)
    if len(rounds) > 1:
        print(
            f"\n{len(rounds)} rounds (each: pipesvc's jobs on a cluster, then torch, per stage "
            "count); median (min-max) of each round's\nratio to torch in the same round.\n"
        )
        base._print_table(rounds_table(rounds))
    for where, message in errors.items():
        print(f"\ntorch.distributed.pipelining failed ({where}):\n{message}")


if __name__ == "__main__":
    main()
