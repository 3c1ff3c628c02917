"""Per-step time of the tiny model in several checkouts of pipesvc, measured side by side.

On a shared machine the load changes from one run of ``overhead.py`` to the next more than a
change to the control plane does. Here every checkout (a directory holding a copy of the
repository, e.g. from ``git archive REV | tar -x -C DIR``) runs its own ``LocalCluster``
(1 thread per stage) and job at the same time, and in each round every checkout takes one
``train_step`` in turn, in a rotating order, so all of them see the same load. The model,
batch, micro-batches and optimizer are ``overhead.py``'s tiny row: 4 x (Linear(32, 32) + ReLU),
batch 64 in 4 micro-batches, MSE, SGD; GPipe and 1F1B, checkpoints off and every 10 steps.

With ``--workload act`` the model and batch are ``pipeline.py``'s activation-heavy row instead
(8 x (Linear(256, 256) + ReLU), batch 4096 in 8 micro-batches: an 8 MiB batch), where the
batch's way from the client to the stages is a large part of a step.

With ``--train K`` each turn runs K steps through ``job.train`` (pipelined steps over one
stream) instead of one ``train_step``; each figure is then a turn's ms per step. With
``--clip C`` every job clips its global gradient norm to ``C``.

After the table, the context switches per step of each checkout's stage processes (all their
threads, voluntary and not, from ``/proc/<pid>/task/*/status``, over the timed turns of each
row), one figure per stage; then each checkout's CPU ms per step (``/proc/<pid>/stat``, user
and system, over the same turns) as ``coordinator / stage + stage ... / client = total``.

Usage: ``python bench/paired_overhead.py [--stages 2] [--steps 150] [--workload act]
[--every 0,10] [--train K] [--clip C] NAME=DIR [NAME=DIR ...]`` (``.`` is this checkout).
Prints steps/s, mean and p50 ms per step for each checkout and row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARMUP_STEPS = 5


def _stage_pids(parent: int, role: bytes = b"stage") -> list[int]:
    """The ``pipesvc ROLE`` processes (``stage``, ``coordinator``) whose parent is ``parent``,
    in start order (by pid)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and args[1:4] == [b"-m", b"pipesvc", role]:
            pids.append(int(entry))
    return sorted(pids)


def _switches(pid: int) -> int:
    """Context switches so far of the live threads of process ``pid``."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as status:
                for line in status:
                    if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                        total += int(line.split()[1])
        except OSError:
            continue  # the thread ended meanwhile
    return total


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system, every thread) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(num_stages: int, workload: str) -> None:
    """Serves one checkout's job on stdin/stdout: ``setup SCHEDULE EVERY [CLIP]``, ``step``,
    ``train K``, ``switches``, ``quit``."""
    root = Path(os.environ["PIPESVC_TREE"]).resolve()
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = str(root)  # the stage processes import bench.bench_models
    import pipesvc
    from bench import overhead, pipeline

    if workload == "act":
        model, lr, microbatches = pipeline.ACT, pipeline.LR, pipeline.NUM_MICROBATCHES
        x, y = pipeline._batch(pipeline.ACT)
    else:
        model, lr, microbatches = overhead.TINY, overhead.LR, overhead.NUM_MICROBATCHES
        x, y = overhead._batch(overhead.TINY)

    with pipesvc.LocalCluster(
        num_stages=num_stages, models=["bench.bench_models"], threads_per_stage=1
    ) as cluster:
        client = cluster.connect()
        job = None
        print("ready", flush=True)
        for line in sys.stdin:
            command = line.split()
            if command[0] == "setup":
                if job is not None:
                    job.close()
                job = client.create_job(
                    model=model.model,
                    model_args=model.model_args,
                    num_stages=num_stages,
                    num_microbatches=microbatches,
                    schedule=command[1],
                    optimizer={"name": "sgd", "lr": lr},
                    loss=model.loss,
                    partition="uniform",
                    checkpoint_every=int(command[2]),
                    clip_grad_norm=float(command[3]) if len(command) > 3 else None,
                )
                print("ok", flush=True)
            elif command[0] == "step" and job is not None:
                started = time.perf_counter()
                job.train_step(x, y)
                print(f"{(time.perf_counter() - started) * 1e3:.4f}", flush=True)
            elif command[0] == "train" and job is not None:
                count = int(command[1])
                started = time.perf_counter()
                for _ in job.train([(x, y)] * count):
                    pass
                print(f"{(time.perf_counter() - started) * 1e3 / count:.4f}", flush=True)
            elif command[0] == "cpu":  # coordinator, stages, this client: CPU seconds so far
                me = os.getpid()
                pids = [*_stage_pids(me, b"coordinator"), *_stage_pids(me)]
                print(" ".join(f"{_cpu_s(pid):.3f}" for pid in [*pids, me]), flush=True)
            elif command[0] == "switches":
                counts = [_switches(pid) for pid in _stage_pids(os.getpid())]
                print(" ".join(str(c) for c in counts), flush=True)
            else:
                break
        client.close()


class Checkout:
    """One worker process and its pipes."""

    def __init__(self, directory: Path, num_stages: int, workload: str) -> None:
        env = dict(os.environ, PIPESVC_TREE=str(directory), PYTHONPATH=str(directory))
        script = str(Path(__file__).resolve())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                script,
                "--worker",
                "--stages",
                str(num_stages),
                "--workload",
                workload,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=directory,
        )
        if self.ask(None) != "ready":
            raise RuntimeError(f"the cluster of {directory} did not start")

    def ask(self, command: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per checkout and row")
    parser.add_argument(
        "--workload",
        choices=("tiny", "act"),
        default="tiny",
        help="tiny: overhead.py's tiny row; act: pipeline.py's activation-heavy row (8 MiB "
        "batch, 8 micro-batches), whose step time the batch's way to the stages shows in",
    )
    parser.add_argument("--every", default="0,10", help="checkpoint_every values (0: off)")
    parser.add_argument(
        "--train",
        type=int,
        default=0,
        metavar="K",
        help="each turn runs K steps through job.train (pipelined steps) instead of one "
        "train_step; a figure is the turn's ms per step (0: train_step)",
    )
    parser.add_argument(
        "--clip", type=float, default=None, help="clip each job's global gradient norm to this"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("trees", nargs="*", metavar="NAME=DIR")
    args = parser.parse_args()
    if args.worker:
        worker(args.stages, args.workload)
        return
    named = dict(t.split("=", 1) for t in args.trees)
    if not named:
        parser.error("name at least one checkout as NAME=DIR")
    checkouts = {
        name: Checkout(Path(d).resolve(), args.stages, args.workload) for name, d in named.items()
    }
    names = list(checkouts)
    each = f"{args.train} steps of job.train" if args.train else "one train_step"
    print(
        f"{args.workload} model, {args.stages} stages, {args.steps} timed steps per checkout "
        "and row "
        f"({WARMUP_STEPS} warm-up), {each} each in turn; {os.cpu_count()} CPU cores; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    header = ["schedule", "ckpt"]
    for name in names:
        header += [f"{name} steps/s", "ms", "p50 ms"]
    rows = [header]
    switch_rows = [["schedule", "ckpt", *(f"{name} switches/step" for name in names)]]
    cpu_rows = [["schedule", "ckpt", *(f"{name} cpu ms/step" for name in names)]]
    try:
        for schedule in ("gpipe", "1f1b"):
            for every in (int(e) for e in args.every.split(",")):
                for checkout in checkouts.values():
                    clip = "" if args.clip is None else f" {args.clip}"
                    if checkout.ask(f"setup {schedule} {every}{clip}") != "ok":
                        raise RuntimeError("a job could not be created")
                    for _ in range(WARMUP_STEPS):
                        checkout.ask("step")
                turn = f"train {args.train}" if args.train else "step"
                times: dict[str, list[float]] = {name: [] for name in names}
                before = {name: checkouts[name].ask("switches").split() for name in names}
                cpu_before = {name: checkouts[name].ask("cpu").split() for name in names}
                turns = max(1, args.steps // max(1, args.train))
                for i in range(turns):
                    for name in names[i % len(names) :] + names[: i % len(names)]:
                        times[name].append(float(checkouts[name].ask(turn)))
                steps = turns * max(1, args.train)
                cpus = []
                for name in names:
                    after = checkouts[name].ask("cpu").split()
                    used = [
                        (float(a) - float(b)) * 1e3 / steps
                        for a, b in zip(after, cpu_before[name], strict=True)
                    ]
                    coordinator, stages, client = used[0], used[1:-1], used[-1]
                    cpus.append(
                        f"{coordinator:.2f} / {' + '.join(f'{t:.2f}' for t in stages)} / "
                        f"{client:.2f} = {sum(used):.2f}"
                    )
                switches = []
                for name in names:
                    after = checkouts[name].ask("switches").split()
                    per_stage = [
                        (int(a) - int(b)) / steps for a, b in zip(after, before[name], strict=True)
                    ]
                    switches.append(" / ".join(f"{n:.1f}" for n in per_stage))
                row = [schedule, f"every {every}" if every else "off"]
                switch_rows.append([*row, *switches])
                cpu_rows.append([*row, *cpus])
                for name in names:
                    mean, median = statistics.fmean(times[name]), statistics.median(times[name])
                    row += [f"{1e3 / mean:.1f}", f"{mean:.2f}", f"{median:.2f}"]
                rows.append(row)
    finally:
        for checkout in checkouts.values():
            checkout.close()
    for table in (rows, switch_rows, cpu_rows):
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for row in table:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
