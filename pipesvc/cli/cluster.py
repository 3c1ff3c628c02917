"""Commands that look at a running cluster: ``status``, ``trace`` and ``health``."""

from __future__ import annotations

import argparse
from typing import Any

from pipesvc.cli.common import add_coordinator_flags, add_security_flags, print_table, security_of


def _cmd_status(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    with Client(args.coordinator, security=security_of(args), timeout_s=args.timeout_s) as client:
        stages = client.stages()
    header = (
        "ADDRESS",
        "DEVICE",
        "MEMORY",
        "RSS",
        "JOB",
        "LAYERS",
        "RANK",
        "MICROBATCH/S",
        "HEALTH",
    )
    rows = [header]
    for s in stages:
        layers = f"[{s.start_layer}, {s.end_layer})" if s.job_id else "-"
        rows.append(
            (
                s.address,
                s.device,
                f"{s.memory_bytes / 2**30:.1f} GiB",
                f"{s.rss_bytes / 2**20:.0f} MiB" if s.rss_bytes else "-",
                s.job_id or "-",
                layers,
                str(s.rank) if s.job_id else "-",
                f"{s.microbatches_per_s:.1f}" if s.job_id else "-",
                s.health,
            )
        )
    print_table(rows)
    print(f"{len(stages)} stage(s) registered with {args.coordinator}")
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    with Client(args.coordinator, security=security_of(args), timeout_s=args.timeout_s) as client:
        json_path, png_path = client.get_job(args.job).trace(args.out, max_runs=args.runs)
    print(f"wrote {json_path} (open in https://ui.perfetto.dev) and {png_path}")
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    from pipesvc.wire.transport import check_health

    status = check_health(args.target, args.timeout_s, security_of(args))
    print(status)
    return 0 if status == "SERVING" else 1


def add_cluster_commands(sub: Any) -> None:
    """Adds ``status``, ``trace`` and ``health``."""
    p = sub.add_parser("status", help="print the stages registered with a coordinator")
    add_coordinator_flags(p, timeout_s=10.0)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("trace", help="write a job's recent runs as Chrome trace JSON and a PNG")
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--out", required=True, help="output stem: OUT.json and OUT.png")
    p.add_argument("--runs", type=int, default=5, help="newest runs to include (default 5)")
    add_coordinator_flags(p, timeout_s=30.0)
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser("health", help="exit 0 only if the server at --target is SERVING")
    p.add_argument("--target", required=True, help="HOST:PORT of any pipesvc server")
    p.add_argument("--timeout-s", type=float, default=2.0)
    add_security_flags(p)
    p.set_defaults(func=_cmd_health)
