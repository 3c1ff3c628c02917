"""What the commands share: security, limits and metrics flags, signals, tables."""

from __future__ import annotations

import argparse
import inspect
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pipesvc.coordinator.options import DEFAULT_COORDINATOR
from pipesvc.core.limits import Limits
from pipesvc.core.option_flags import add_flags, flag_values
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.wire.security import Security

logger = logging.getLogger("pipesvc")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def param_default(function: Callable[..., object], name: str) -> Any:
    """The default of keyword ``name`` of ``function`` (for settings passed as arguments)."""
    default = inspect.signature(function).parameters[name].default
    if default is inspect.Parameter.empty:
        raise KeyError(f"{function.__qualname__} has no default for {name!r}")
    return default


def stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def security_of(args: argparse.Namespace) -> Security:
    return Security.from_files(
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
    )


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(**flag_values(args, Limits, every_field=True))


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("auth and TLS")
    group.add_argument("--token-file", help="file whose first line is the cluster's shared token")
    group.add_argument("--tls-cert", help="PEM certificate chain this process presents")
    group.add_argument("--tls-key", help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-ca", help="PEM CA that peers must chain to (on a server: requires client certs)"
    )


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits (exceeding one gets RESOURCE_EXHAUSTED)")
    add_flags(group, Limits, every_field=True)


def metrics_of(args: argparse.Namespace) -> Metrics:
    if args.metrics_port is None:
        return NO_METRICS
    from pipesvc.observe.metrics import PrometheusMetrics

    metrics = PrometheusMetrics()
    host = args.listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
    port = metrics.serve(args.metrics_port, host)
    logger.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)
    return metrics


def add_metrics_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port, on the --listen host (0: any free port)",
    )


def warn_if_exposed(listen: str, security: Security) -> None:
    host = listen.rpartition(":")[0]
    if host not in LOOPBACK_HOSTS and not security.authenticated:
        logger.warning(
            "listening on %s without authentication: anyone who can reach it can drive it", listen
        )


def _hf_model(text: str) -> tuple[str, str]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    return name, directory


def add_hf_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hf-model",
        type=_hf_model,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the Hugging Face model in DIR (config.json and safetensors) under NAME; "
        "requests name only NAME (repeatable)",
    )


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Prints rows (the header first) in columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def add_coordinator_flags(p: argparse.ArgumentParser, timeout_s: float) -> None:
    p.add_argument(
        "--coordinator", default=DEFAULT_COORDINATOR, help="HOST:PORT (default %(default)s)"
    )
    p.add_argument("--timeout-s", type=float, default=timeout_s)
    add_security_flags(p)
