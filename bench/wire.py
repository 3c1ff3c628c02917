"""Training across a 1 Gbit/s link with activations and gradients in float32, bfloat16 and
float16 on the wire (``wire_dtype``).

Two network namespaces joined by a veth pair, each end shaped with ``tc ... tbf rate 1gbit``:
the coordinator and stage 0 in the first, stage 1 in the second, so everything between the
stages crosses the shaped link, as frames on the gRPC stream (``--shm-bytes 0``: hosts share
no memory). Model: ``bench-mlp`` (2 x Linear(64, 64) + ReLU, one per stage), batch 16384 in 4
micro-batches of 4096 rows: 1 MiB of float32 activations per micro-batch each way and little
compute, MSE, SGD, 1 torch thread per stage. Columns: ms per step (mean of ``--steps`` after 3
warm-up steps) and the ratio to float32 on the same link; ``--no-shape`` runs the same without
tc, for comparison.

Needs root (``ip netns``, ``tc``). Creates only the namespaces ``pswire-a`` and ``pswire-b``
and removes them, and every process it started, at the end.

Usage: ``python bench/wire.py [--steps 20] [--no-shape]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NS = ("pswire-a", "pswire-b")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
WIDTH, DEPTH, BATCH, MICROBATCHES = 64, 2, 16384, 4


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_hosts(shape: bool) -> Iterator[None]:
    created: list[str] = []
    try:
        for ns in NS:
            ip("netns", "add", ns)
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip(
            "link",
            "add",
            "pswa",
            "netns",
            NS[0],
            "type",
            "veth",
            "peer",
            "name",
            "pswb",
            "netns",
            NS[1],
        )
        for ns, dev, address in zip(NS, ("pswa", "pswb"), ADDRESSES, strict=True):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            if shape:
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", "1gbit", "burst", "256kb", "latency", "50ms"],
                    check=True, capture_output=True, timeout=30,
                )  # fmt: skip
        yield
    finally:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def spawn(ns: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "pipesvc", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )


def client(coordinator: str, steps: int) -> None:
    """Runs inside the first namespace: one job per wire dtype, timed."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    import pipesvc

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    with pipesvc.connect(coordinator, timeout_s=300) as c:
        deadline = time.monotonic() + 120
        while True:  # the coordinator may not listen yet
            try:
                if sum(s.health == "SERVING" for s in c.stages()) >= 2:
                    break
            except pipesvc.PipesvcError:
                pass
            if time.monotonic() > deadline:
                sys.exit("the stages did not register")
            time.sleep(0.2)
        base = 0.0
        print(f"{'wire':<10} {'ms/step':>8} {'x float32':>10}")
        for wire in (None, "bfloat16", "float16"):
            with c.create_job(
                model="bench-mlp",
                model_args={"width": WIDTH, "depth": DEPTH},
                num_stages=2,
                num_microbatches=MICROBATCHES,
                loss="mse",
                optimizer={"name": "sgd", "lr": 1e-3},
                partition="uniform",
                checkpoint_every=0,
                wire_dtype=wire,
            ) as job:
                for _ in range(3):
                    job.train_step(x, y)
                times = []
                for _ in range(steps):
                    started = time.perf_counter()
                    job.train_step(x, y)
                    times.append(time.perf_counter() - started)
            ms = 1e3 * statistics.fmean(times)
            base = base or ms
            print(f"{wire or 'float32':<10} {ms:8.1f} {base / ms:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-shape", action="store_true", help="no tc: the veth at full rate")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client, args.steps)
        return
    coordinator = f"{ADDRESSES[0]}:7071"
    procs: list[subprocess.Popen[bytes]] = []
    with two_hosts(not args.no_shape), tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        try:
            procs.append(
                spawn(NS[0], ["coordinator", "--listen", coordinator, "--state-dir", tmp],
                      logs / "coordinator.log")
            )  # fmt: skip
            for rank, (ns, address) in enumerate(zip(NS, ADDRESSES, strict=True)):
                procs.append(
                    spawn(ns, ["stage", "--coordinator", coordinator, "--listen", f"{address}:0",
                               "--threads", "1", "--shm-bytes", "0",
                               "--models", "bench.bench_models"],
                          logs / f"stage-{rank}.log")
                )  # fmt: skip
            result = subprocess.run(
                ["ip", "netns", "exec", NS[0], sys.executable, __file__, "--client", coordinator,
                 "--steps", str(args.steps)],
                cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                for log in sorted(logs.glob("*.log")):
                    print(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


if __name__ == "__main__":
    main()
