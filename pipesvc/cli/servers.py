"""The server commands: ``coordinator``, ``stage`` and ``up`` (a local cluster)."""

from __future__ import annotations

import argparse
from typing import Any

from pipesvc.cli.common import (
    add_hf_model_flag,
    add_limit_flags,
    add_metrics_flag,
    add_security_flags,
    limits_of,
    metrics_of,
    param_default,
    security_of,
    stop_on_signals,
    warn_if_exposed,
)
from pipesvc.coordinator.options import DEFAULT_COORDINATOR, CoordinatorOptions
from pipesvc.coordinator.stage_calls import Deadlines
from pipesvc.core.limits import parse_bytes
from pipesvc.core.option_flags import add_flags, flag_values
from pipesvc.stage.options import StageOptions


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from pipesvc.coordinator.server import run_coordinator
    from pipesvc.stage.dataplane.malloc import single_arena

    single_arena()
    security = security_of(args)
    warn_if_exposed(args.listen, security)
    options = CoordinatorOptions(
        deadlines=Deadlines(**flag_values(args, Deadlines)),
        security=security,
        limits=limits_of(args),
        metrics=metrics_of(args),
        **flag_values(args, CoordinatorOptions),
    )
    run_coordinator(options, stop_on_signals())
    return 0


def _cmd_stage(args: argparse.Namespace) -> int:
    import torch

    from pipesvc import models
    from pipesvc.stage.compute.faults import FaultKill
    from pipesvc.stage.dataplane.malloc import tune_malloc
    from pipesvc.stage.server import device_memory_bytes, run_stage, stage_device

    if args.threads:
        torch.set_num_threads(args.threads)
    tune_malloc()
    if args.models:
        models.import_model_modules(args.models)
    for name, directory in args.hf_model:
        models.register_hf_model(name, directory)
    security = security_of(args)
    warn_if_exposed(args.listen, security)
    device = stage_device(args.device)
    run_stage(
        StageOptions(
            address="",
            device=device,
            memory_bytes=(
                parse_bytes(args.memory_budget)
                if args.memory_budget
                else device_memory_bytes(device)
            ),
            security=security,
            limits=limits_of(args),
            serve_control=not args.no_control_stream,
            fault_kill=FaultKill.parse(args.fault_kill) if args.fault_kill else None,
            metrics=metrics_of(args),
            **flag_values(args, StageOptions),
        ),
        coordinator=args.coordinator,
        listen=args.listen,
        advertise=args.advertise,
        register_timeout_s=args.register_timeout_s,
        stop=stop_on_signals(),
        heartbeat_interval_s=args.heartbeat_interval_s,
        drain_timeout_s=args.drain_timeout_s,
    )
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from pipesvc.local_cluster import LocalCluster

    stop = stop_on_signals()
    cluster = LocalCluster(
        args.stages,
        models=args.models or (),
        hf_models=dict(args.hf_model),
        threads_per_stage=args.threads_per_stage,
        generate_threads=args.generate_threads,
        device=args.device,
        state_dir=args.state_dir,
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        listen=args.listen,
        coordinator_args=["--http-port", str(args.http_port)] if args.http_port is not None else (),
    )
    with cluster:
        print(
            f"pipesvc cluster up: coordinator at {cluster.address}, {args.stages} stages",
            flush=True,
        )
        print("press Ctrl-C to stop", flush=True)
        stop.wait()
    print("pipesvc cluster stopped", flush=True)
    return 0


def add_server_commands(sub: Any) -> None:
    """Adds ``coordinator``, ``stage`` and ``up``."""
    _add_coordinator_command(sub)
    _add_stage_command(sub)
    _add_up_command(sub)


def _add_coordinator_command(sub: Any) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator server")
    add_flags(p, CoordinatorOptions)
    add_flags(p, Deadlines)
    add_metrics_flag(p)
    add_security_flags(p)
    add_limit_flags(p)
    p.set_defaults(func=_cmd_coordinator)


def _add_stage_command(sub: Any) -> None:
    from pipesvc.stage.server import run_stage

    p = sub.add_parser("stage", help="run a stage server that registers with a coordinator")
    p.add_argument("--coordinator", required=True, help="coordinator HOST:PORT")
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT; port 0 picks a free one (default %(default)s)",
    )
    p.add_argument("--advertise", help="HOST:PORT others dial (default: the bound address)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument(
        "--models",
        action="append",
        default=[],
        help="import this module so its models can be built (repeatable)",
    )
    add_hf_model_flag(p)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument(
        "--register-timeout-s",
        type=float,
        default=60.0,
        help="how long to wait for the coordinator at start (default %(default)s)",
    )
    p.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=param_default(run_stage, "heartbeat_interval_s"),
        help="re-register with the coordinator this often (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=param_default(run_stage, "drain_timeout_s"),
        help="on SIGTERM, wait this long for the coordinator to move the layers away "
        "(default %(default)s)",
    )
    p.add_argument(
        "--memory-budget",
        help="memory the planner may fill on this stage, e.g. 8GiB (default: free now)",
    )
    add_flags(p, StageOptions)
    # Version-skew tests: a stage without the Control stream, as one built before it.
    p.add_argument("--no-control-stream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fault-kill", help=argparse.SUPPRESS)
    add_metrics_flag(p)
    add_security_flags(p)
    add_limit_flags(p)
    p.set_defaults(func=_cmd_stage)


def _add_up_command(sub: Any) -> None:
    p = sub.add_parser("up", help="run a local cluster in the foreground until Ctrl-C")
    p.add_argument(
        "--listen",
        default=DEFAULT_COORDINATOR,
        help="the coordinator's HOST:PORT, where `status` and `trace` look by default "
        "(default %(default)s; HOST:0 for any free port)",
    )
    p.add_argument("--stages", type=int, default=4, help="stage processes (default %(default)s)")
    p.add_argument("--models", action="append", default=[], help="model module (repeatable)")
    add_hf_model_flag(p)
    p.add_argument("--threads-per-stage", type=int, help="default: cores / stages")
    p.add_argument(
        "--generate-threads", type=int, help="a stage's threads in generation (default: cores)"
    )
    p.add_argument("--device", help="device of every stage")
    p.add_argument("--state-dir", help="coordinator state directory (default: temporary)")
    p.add_argument(
        "--http-port",
        type=int,
        help="the coordinator's live page and OpenAI-compatible API on this port, on the "
        "--listen host (0: any free port; default: none)",
    )
    add_security_flags(p)
    p.set_defaults(func=_cmd_up)
