"""The ``demo`` command: the built-in GPT trained on a local cluster (the main job)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipesvc.cli.common import add_security_flags, security_of, stop_on_signals
from pipesvc.coordinator.options import DEFAULT_COORDINATOR
from pipesvc.core.option_flags import field_default
from pipesvc.core.schedule import schedule_names


def _cmd_demo(args: argparse.Namespace) -> int:
    from pipesvc.demo import DemoOptions, run_demo

    if args.listen and args.coordinator:
        print(
            "pipesvc demo: --listen is for the demo's own cluster, not --coordinator's",
            file=sys.stderr,
        )
        return 2
    # A kept job's local cluster listens where `generate`, `job` and `status` look.
    listen = args.listen or (DEFAULT_COORDINATOR if args.keep_job else "127.0.0.1:0")
    run_demo(
        DemoOptions(
            keep_job=args.keep_job,
            listen=listen,
            num_stages=args.stages,
            duration_s=args.minutes * 60,
            max_steps=args.max_steps,
            schedule=args.schedule,
            coordinator=args.coordinator,
            security=security_of(args),
        ),
        hold=lambda: stop_on_signals().wait(),  # Ctrl-C still stops the training before
    )
    return 0


def add_demo_command(sub: Any) -> None:
    """Adds ``demo``."""
    from pipesvc.demo import DemoOptions

    p = sub.add_parser("demo", help="train the built-in GPT on a local cluster (the main job)")
    p.add_argument(
        "--stages",
        type=int,
        default=field_default(DemoOptions, "num_stages"),
        help="pipeline stages (default %(default)s)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=field_default(DemoOptions, "duration_s") / 60,
        help="training time (default %(default)s)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=field_default(DemoOptions, "max_steps"),
        help="stop after this many steps (0: none)",
    )
    p.add_argument(
        "--schedule",
        default=field_default(DemoOptions, "schedule"),
        choices=schedule_names(),
        help="pipeline schedule (default %(default)s)",
    )
    p.add_argument(
        "--coordinator", help="train on this running cluster (HOST:PORT) instead of a local one"
    )
    p.add_argument(
        "--keep-job",
        action="store_true",
        help="leave the trained job open and print its id (for generate, trace, job close); "
        "the demo's own cluster then keeps running until Ctrl-C",
    )
    p.add_argument(
        "--listen",
        help=f"where the demo's own cluster's coordinator listens (default: {DEFAULT_COORDINATOR} "
        "with --keep-job, where generate looks; else any free port)",
    )
    add_security_flags(p)
    p.set_defaults(func=_cmd_demo)
