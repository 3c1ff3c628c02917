"""The ``pipesvc`` command line: coordinator, stage, up, demo, status, job, trace, generate,
health.

This is the only module that reads flags and installs logging handlers.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pipesvc.coordinator.options import DEFAULT_COORDINATOR, CoordinatorOptions
from pipesvc.coordinator.stage_calls import Deadlines
from pipesvc.core.limits import Limits, parse_bytes
from pipesvc.core.option_flags import add_flags, field_default, flag_values
from pipesvc.core.schedule import schedule_names
from pipesvc.errors import PipesvcError
from pipesvc.observe import logs
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.owner import follow_owner
from pipesvc.stage.options import StageOptions
from pipesvc.wire.security import Security

logger = logging.getLogger("pipesvc")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def _param_default(function: Callable[..., object], name: str) -> Any:
    """The default of keyword ``name`` of ``function`` (for settings passed as arguments)."""
    default = inspect.signature(function).parameters[name].default
    if default is inspect.Parameter.empty:
        raise KeyError(f"{function.__qualname__} has no default for {name!r}")
    return default


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _security(args: argparse.Namespace) -> Security:
    return Security.from_files(
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
    )


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(**flag_values(args, Limits, every_field=True))


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("auth and TLS")
    group.add_argument("--token-file", help="file whose first line is the cluster's shared token")
    group.add_argument("--tls-cert", help="PEM certificate chain this process presents")
    group.add_argument("--tls-key", help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-ca", help="PEM CA that peers must chain to (on a server: requires client certs)"
    )


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits (exceeding one gets RESOURCE_EXHAUSTED)")
    add_flags(group, Limits, every_field=True)


def _metrics(args: argparse.Namespace) -> Metrics:
    if args.metrics_port is None:
        return NO_METRICS
    from pipesvc.observe.metrics import PrometheusMetrics

    metrics = PrometheusMetrics()
    host = args.listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
    port = metrics.serve(args.metrics_port, host)
    logger.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)
    return metrics


def _add_metrics_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port, on the --listen host (0: any free port)",
    )


def _warn_if_exposed(listen: str, security: Security) -> None:
    host = listen.rpartition(":")[0]
    if host not in LOOPBACK_HOSTS and not security.authenticated:
        logger.warning(
            "listening on %s without authentication: anyone who can reach it can drive it", listen
        )


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from pipesvc.coordinator.server import run_coordinator
    from pipesvc.stage.dataplane.malloc import single_arena

    single_arena()
    security = _security(args)
    _warn_if_exposed(args.listen, security)
    options = CoordinatorOptions(
        deadlines=Deadlines(**flag_values(args, Deadlines)),
        security=security,
        limits=_limits(args),
        metrics=_metrics(args),
        **flag_values(args, CoordinatorOptions),
    )
    run_coordinator(options, _stop_on_signals())
    return 0


def _hf_model(text: str) -> tuple[str, str]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    return name, directory


def _add_hf_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hf-model",
        type=_hf_model,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the Hugging Face model in DIR (config.json and safetensors) under NAME; "
        "requests name only NAME (repeatable)",
    )


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
    security = _security(args)
    _warn_if_exposed(args.listen, security)
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
            limits=_limits(args),
            serve_control=not args.no_control_stream,
            fault_kill=FaultKill.parse(args.fault_kill) if args.fault_kill else None,
            metrics=_metrics(args),
            **flag_values(args, StageOptions),
        ),
        coordinator=args.coordinator,
        listen=args.listen,
        advertise=args.advertise,
        register_timeout_s=args.register_timeout_s,
        stop=_stop_on_signals(),
        heartbeat_interval_s=args.heartbeat_interval_s,
        drain_timeout_s=args.drain_timeout_s,
    )
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from pipesvc.local_cluster import LocalCluster

    stop = _stop_on_signals()
    cluster = LocalCluster(
        args.stages,
        models=args.models or (),
        hf_models=dict(args.hf_model),
        threads_per_stage=args.threads_per_stage,
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


def _cmd_status(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    with Client(args.coordinator, security=_security(args), timeout_s=args.timeout_s) as client:
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
    _print_table(rows)
    print(f"{len(stages)} stage(s) registered with {args.coordinator}")
    return 0


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    """Prints rows (the header first) in columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _cmd_trace(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    with Client(args.coordinator, security=_security(args), timeout_s=args.timeout_s) as client:
        json_path, png_path = client.get_job(args.job).trace(args.out, max_runs=args.runs)
    print(f"wrote {json_path} (open in https://ui.perfetto.dev) and {png_path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from pipesvc.client import Client
    from pipesvc.tokenizer import text_codec

    with Client(args.coordinator, security=_security(args), timeout_s=args.timeout_s) as client:
        job = client.get_job(args.job)
        codec = text_codec(job, args.tokenizer)
        prompt = codec.encode(args.prompt)
        if not prompt:
            print("pipesvc generate: the prompt has no token the tokenizer knows", file=sys.stderr)
            return 2
        steps = job.stream(
            torch.tensor([prompt]),
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_token_id=args.eos_token_id,
        )
        # The first token before anything is shown: a request the job refuses (too long for
        # the model's positions, bad settings) prints only the error.
        first = next(steps, None)
        # What the model sees of the prompt, then the text of the prompt and the new tokens
        # decoded together (a tokenizer may join or split characters across tokens).
        shown = codec.decode(prompt)
        print(shown, end="", flush=True)
        new: list[int] = []
        for tokens in itertools.chain([] if first is None else [first], steps):
            new.append(int(tokens[0]))
            text = codec.decode(prompt + new)
            if text.startswith(shown):
                print(text[len(shown) :], end="", flush=True)
                shown = text
        print(flush=True)
    return 0


def _model_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON (``vocab_size=103``, ``lora={"r": 8}``), else
    kept as a string (``name=tiny``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _cmd_job_create(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    optimizer = None if args.inference else {"name": args.optimizer, "lr": args.lr}
    with Client(args.coordinator, security=_security(args), timeout_s=args.timeout_s) as client:
        job = client.create_job(
            model=args.model,
            model_args=dict(args.model_arg),
            seed=args.seed,
            num_stages=args.stages,
            num_microbatches=args.microbatches,
            schedule=args.schedule,
            optimizer=optimizer,
            loss=args.loss,
            partition=args.partition,
            precision=args.precision,
            wait_for_stages_s=args.wait_for_stages_s,
            name=args.name,
            prefill_chunk=args.prefill_chunk,
            wire_dtype=args.wire_dtype,
        )
    # The id alone on stdout, so `JOB=$(pipesvc job create ...)` works; the plan for people.
    print(job.id, flush=True)
    print(f"created job {job.id}: {job.num_layers} layers of {args.model!r}", file=sys.stderr)
    for stage in job.plan:
        print(
            f"  rank {stage.rank}: layers [{stage.start_layer}, {stage.end_layer}) on "
            f"{stage.address}",
            file=sys.stderr,
        )
    if args.wire_dtype is not None:
        ranks = len({s.rank for s in job.plan})
        for link in job.links:
            print(f"  link {link.describe(ranks)}", file=sys.stderr)
    return 0


def _wire_dtype(text: str) -> str | dict[str, str | None]:
    """``--wire-dtype``: a codec's name, ``auto``, or ``activations=C,gradients=C``."""
    if "=" not in text:
        return text
    roles: dict[str, str | None] = {}
    for item in text.split(","):
        role, _, codec = item.partition("=")
        roles[role.strip()] = codec.strip() or None
    return roles


def _cmd_job_list(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    with Client(args.coordinator, security=_security(args), timeout_s=args.timeout_s) as client:
        jobs = client.jobs()
    rows = [("JOB", "MODEL", "STEP", "STAGES", "SCHEDULE", "OPTIMIZER")]
    rows += [
        (
            job.id,
            job.config.model,
            str(job.step),
            str(len({s.address for s in job.plan})),  # chunks and replicas counted once
            job.config.schedule,
            str(job.config.optimizer.get("name", "-")),
        )
        for job in jobs
    ]
    _print_table(rows)
    print(f"{len(jobs)} open job(s) on {args.coordinator}")
    return 0


def _cmd_job_close(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    with Client(args.coordinator, security=_security(args), timeout_s=args.timeout_s) as client:
        client.get_job(args.job_id).close()
    print(f"closed job {args.job_id}")
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    from pipesvc.wire.transport import check_health

    status = check_health(args.target, args.timeout_s, _security(args))
    print(status)
    return 0 if status == "SERVING" else 1


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
            security=_security(args),
        ),
        hold=lambda: _stop_on_signals().wait(),  # Ctrl-C still stops the training before
    )
    return 0


def _add_coordinator_flags(p: argparse.ArgumentParser, timeout_s: float) -> None:
    p.add_argument(
        "--coordinator", default=DEFAULT_COORDINATOR, help="HOST:PORT (default %(default)s)"
    )
    p.add_argument("--timeout-s", type=float, default=timeout_s)
    _add_security_flags(p)


def _add_job_commands(sub: Any) -> None:
    """``pipesvc job create|list|close``: from a running cluster to a job id (which
    ``status``, ``generate`` and ``trace`` take) and back."""
    from pipesvc.client import Client
    from pipesvc.core.optim import DEFAULT_OPTIMIZER

    job = sub.add_parser("job", help="create, list and close jobs on a running cluster")
    commands = job.add_subparsers(dest="job_command", required=True)

    def default(name: str) -> Any:
        return _param_default(Client.create_job, name)

    p = commands.add_parser(
        "create",
        help="plan and assign a job; prints its id alone on stdout (the plan on stderr)",
        description="Plans and assigns a job, as Client.create_job does; prints its id alone "
        "on stdout, so JOB=$(pipesvc job create ...) works, and the plan on stderr.",
    )
    p.add_argument("--model", required=True, help="a model the stages serve (gpt, mlp, ...)")
    p.add_argument(
        "--model-arg",
        type=_model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model argument, VALUE read as JSON when it is JSON (vocab_size=103, "
        "lora='{\"r\": 8}'), else as a string (repeatable)",
    )
    p.add_argument(
        "--stages", type=int, default=default("num_stages"), help="(default %(default)s)"
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=default("num_microbatches"),
        help="micro-batches per step (default %(default)s)",
    )
    p.add_argument(
        "--schedule",
        default=default("schedule"),
        choices=schedule_names(),
        help="(default %(default)s)",
    )
    p.add_argument(
        "--optimizer",
        default=DEFAULT_OPTIMIZER["name"],
        help="optimizer name (default %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=DEFAULT_OPTIMIZER["lr"],
        help="learning rate (default %(default)s)",
    )
    p.add_argument(
        "--inference",
        action="store_true",
        help="no optimizer: the stages hold weights only (for forward and generate)",
    )
    p.add_argument(
        "--loss",
        default=default("loss"),
        help="(default %(default)s; causal_lm for Hugging Face models)",
    )
    p.add_argument("--partition", default=default("partition"), help="(default %(default)s)")
    p.add_argument("--precision", default=default("precision"), help="(default %(default)s)")
    p.add_argument("--seed", type=int, default=default("seed"), help="(default %(default)s)")
    p.add_argument(
        "--name",
        default=None,
        help="the job's name: the 'model' HTTP clients of the coordinator's OpenAI-compatible "
        "API ask for (default: the job's id)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="generation: prompt tokens per chunk of a long prompt's prefill, whose chunks "
        "overlap on the stages (default 256; 0: whole prompts)",
    )
    p.add_argument(
        "--wire-dtype",
        type=_wire_dtype,
        default=None,
        metavar="CODEC",
        help="how activations and gradients cross links between hosts: bfloat16, float16, "
        "int8, int4, auto, or per role as activations=int8,gradients=bfloat16 (default: the "
        "compute dtype)",
    )
    p.add_argument(
        "--wait-for-stages-s",
        type=float,
        default=default("wait_for_stages_s"),
        help="wait up to this long for enough free stages (default %(default)s: plan at once)",
    )
    _add_coordinator_flags(p, timeout_s=600.0)
    p.set_defaults(func=_cmd_job_create)

    p = commands.add_parser("list", help="print the open jobs: id, model, step, stages")
    _add_coordinator_flags(p, timeout_s=30.0)
    p.set_defaults(func=_cmd_job_list)

    p = commands.add_parser("close", help="close a job and free its stages")
    p.add_argument("job_id", metavar="ID", help="job id (from `job create` or `job list`)")
    _add_coordinator_flags(p, timeout_s=60.0)
    p.set_defaults(func=_cmd_job_close)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from pipesvc.demo import DemoOptions
    from pipesvc.stage.server import run_stage

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

    p = sub.add_parser("coordinator", help="run the coordinator server")
    add_flags(p, CoordinatorOptions)
    add_flags(p, Deadlines)
    _add_metrics_flag(p)
    _add_security_flags(p)
    _add_limit_flags(p)
    p.set_defaults(func=_cmd_coordinator)

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
    _add_hf_model_flag(p)
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
        default=_param_default(run_stage, "heartbeat_interval_s"),
        help="re-register with the coordinator this often (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=_param_default(run_stage, "drain_timeout_s"),
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
    _add_metrics_flag(p)
    _add_security_flags(p)
    _add_limit_flags(p)
    p.set_defaults(func=_cmd_stage)

    p = sub.add_parser("up", help="run a local cluster in the foreground until Ctrl-C")
    p.add_argument(
        "--listen",
        default=DEFAULT_COORDINATOR,
        help="the coordinator's HOST:PORT, where `status` and `trace` look by default "
        "(default %(default)s; HOST:0 for any free port)",
    )
    p.add_argument("--stages", type=int, default=4, help="stage processes (default %(default)s)")
    p.add_argument("--models", action="append", default=[], help="model module (repeatable)")
    _add_hf_model_flag(p)
    p.add_argument("--threads-per-stage", type=int, help="default: cores / stages")
    p.add_argument("--device", help="device of every stage")
    p.add_argument("--state-dir", help="coordinator state directory (default: temporary)")
    p.add_argument(
        "--http-port",
        type=int,
        help="the coordinator's live page and OpenAI-compatible API on this port, on the "
        "--listen host (0: any free port; default: none)",
    )
    _add_security_flags(p)
    p.set_defaults(func=_cmd_up)

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
    _add_security_flags(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("status", help="print the stages registered with a coordinator")
    p.add_argument(
        "--coordinator", default=DEFAULT_COORDINATOR, help="HOST:PORT (default %(default)s)"
    )
    p.add_argument("--timeout-s", type=float, default=10.0)
    _add_security_flags(p)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("trace", help="write a job's recent runs as Chrome trace JSON and a PNG")
    p.add_argument(
        "--coordinator", default=DEFAULT_COORDINATOR, help="HOST:PORT (default %(default)s)"
    )
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--out", required=True, help="output stem: OUT.json and OUT.png")
    p.add_argument("--runs", type=int, default=5, help="newest runs to include (default 5)")
    p.add_argument("--timeout-s", type=float, default=30.0)
    _add_security_flags(p)
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser(
        "generate", help="stream text a job generates after a prompt (per-stage KV caches)"
    )
    p.add_argument(
        "--coordinator", default=DEFAULT_COORDINATOR, help="HOST:PORT (default %(default)s)"
    )
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 for greedy (default %(default)s)"
    )
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the tokens of this much probability")
    p.add_argument("--seed", type=int, help="seed of the sampling")
    p.add_argument("--eos-token-id", type=int, help="stop once this token is generated")
    p.add_argument(
        "--tokenizer",
        help="directory with tokenizer.json (default: the Hugging Face model's directory, when "
        "this machine can read it; the demo's characters for the built-in gpt)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0)
    _add_security_flags(p)
    p.set_defaults(func=_cmd_generate)

    _add_job_commands(sub)

    p = sub.add_parser("health", help="exit 0 only if the server at --target is SERVING")
    p.add_argument("--target", required=True, help="HOST:PORT of any pipesvc server")
    p.add_argument("--timeout-s", type=float, default=2.0)
    _add_security_flags(p)
    p.set_defaults(func=_cmd_health)
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
