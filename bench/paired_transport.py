"""Round trips of ``transport.py``'s frames path in several checkouts of pipesvc, in turns.

On a shared machine one run of ``transport.py`` differs from the next by more than a change to
the data plane does. Here each checkout (a directory holding a copy of the repository) runs the
same echo of one float32 tensor (``transport.py``'s ``pipesvc-frames``, or ``--transport``) in
its own pair of processes, one size and checkout at a time, in rounds, so all see the same
load; a plain gRPC bytes echo (``grpc``) runs in the same rounds as the floor. Besides wall
time it reports CPU time (both processes, all threads, from the start of the echo to its end,
imports excluded) per round trip, which load changes less than wall time.

Usage: ``python bench/paired_transport.py [--sizes 64K,1M,8M] [--rounds 4] NAME=DIR ...``
(``.`` is this checkout). Prints medians of wall and CPU µs per round trip.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

BENCH = Path(__file__).resolve().parent
ITERS_BYTES = 256 << 20  # bytes echoed per run and size (at least 30 round trips)


def _run_timed(role: str, out: str, transport: str, *args: Any) -> None:
    """One side of the echo, timing its own CPU (imports excluded)."""
    sys.path.insert(0, str(BENCH))
    import grpc  # noqa: F401  (imported before the clock starts)
    import torch  # noqa: F401

    import pipesvc.stage.net.links  # noqa: F401

    if TYPE_CHECKING:
        from bench import transport as t
    else:
        import transport as t  # bench/transport.py, by its path (sys.path above)

    start = time.process_time()
    t.TRANSPORTS[transport][0 if role == "server" else 1](*args)
    Path(out, role).write_text(str(time.process_time() - start))


def child(transport: str, size: int, iters: int) -> None:
    """Runs one echo in this checkout (PYTHONPATH); prints its figures as JSON."""
    sys.path.insert(0, str(BENCH))
    if TYPE_CHECKING:
        from bench import transport as t
    else:
        import transport as t  # bench/transport.py, by its path (sys.path above)

    plan = [(size, iters)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        server = ctx.Process(target=_run_timed, args=("server", out, transport, q, plan))
        server.start()
        address = q.get(timeout=120)
        client = ctx.Process(target=_run_timed, args=("client", out, transport, q, address, plan))
        client.start()
        seconds = q.get(timeout=1800)
        client.join(timeout=60)
        server.join(timeout=60)
        cpu = sum(float(Path(out, role).read_text()) for role in ("server", "client"))
    round_trips = iters + t.WARMUP_ROUND_TRIPS
    print(json.dumps({"wall_us": seconds[0] / iters * 1e6, "cpu_us": cpu / round_trips * 1e6}))


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,1M,8M")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--transport", default="pipesvc-frames")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("trees", nargs="*", metavar="NAME=DIR")
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    trees = [tuple(t.split("=", 1)) for t in args.trees] or [("this", ".")]
    runs: list[tuple[str, str, str]] = [
        (n, str(Path(d).resolve()), args.transport) for n, d in trees
    ]
    runs.append(("grpc", str(BENCH.parent), "grpc"))
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    for size in (_size(s) for s in args.sizes.split(",")):
        iters = max(30, min(600, ITERS_BYTES // size))
        for _ in range(args.rounds):
            for name, tree, transport in runs:
                env = {**os.environ, "PYTHONPATH": tree}
                command = [sys.executable, __file__, "--child", transport, str(size), str(iters)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                results.setdefault((size, name), []).append(
                    json.loads(done.stdout.splitlines()[-1])
                )
    print(
        f"Echo round trips of one float32 tensor ({args.transport}; grpc = a plain gRPC bytes "
        f"echo), medians of {args.rounds} runs per checkout and size, in turns; CPU = both "
        "processes, all threads.\n"
    )
    rows = [["size", "checkout", "wall us/RT", "MB/s", "CPU us/RT"]]
    for (size, name), found in results.items():
        wall = statistics.median(r["wall_us"] for r in found)
        cpu = statistics.median(r["cpu_us"] for r in found)
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        rows.append([label, name, f"{wall:.0f}", f"{2 * size / wall:.0f}", f"{cpu:.0f}"])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
