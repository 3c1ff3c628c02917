"""The ``pipesvc`` command line: coordinator, stage, up, demo, status, trace, job, generate,
health.

This is the only package that reads flags and installs logging handlers. Each module adds its
commands to the parser: ``servers`` (coordinator, stage, up), ``demo``, ``cluster`` (status,
trace, health) and ``jobs`` (job create|list|close, generate).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipesvc.cli.cluster import add_cluster_commands
from pipesvc.cli.demo import add_demo_command
from pipesvc.cli.jobs import add_generate_command, add_job_commands
from pipesvc.cli.servers import add_server_commands
from pipesvc.errors import PipesvcError
from pipesvc.observe import logs
from pipesvc.owner import follow_owner


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="pipesvc", description="Pipeline-parallel PyTorch training as a gRPC service cluster."
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text for people, json (one object per line) for machines",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_commands(sub)
    add_demo_command(sub)
    add_cluster_commands(sub)
    add_generate_command(sub)
    add_job_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipesvc`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "stage":
        from pipesvc.stage.dataplane.malloc import reexec_with_tunables

        reexec_with_tunables(sys.argv[1:] if argv is None else list(argv))
    logs.install(args.log_level, args.log_format)
    if not follow_owner():
        print(f"pipesvc {args.command}: the process that started it is gone", file=sys.stderr)
        return 1
    try:
        return int(args.func(args))
    except PipesvcError as exc:
        print(f"pipesvc {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
