"""The job commands: ``job create|list|close`` and ``generate``."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

from pipesvc.cli.common import (
    add_coordinator_flags,
    param_default,
    print_table,
    security_of,
)
from pipesvc.core.schedule import schedule_names


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from pipesvc.client import Client
    from pipesvc.tokenizer import text_codec

    with Client(args.coordinator, security=security_of(args), timeout_s=args.timeout_s) as client:
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
    with Client(args.coordinator, security=security_of(args), timeout_s=args.timeout_s) as client:
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
            decode_steps=args.decode_steps,
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

    with Client(args.coordinator, security=security_of(args), timeout_s=args.timeout_s) as client:
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
    print_table(rows)
    print(f"{len(jobs)} open job(s) on {args.coordinator}")
    return 0


def _cmd_job_close(args: argparse.Namespace) -> int:
    from pipesvc.client import Client

    with Client(args.coordinator, security=security_of(args), timeout_s=args.timeout_s) as client:
        client.get_job(args.job_id).close()
    print(f"closed job {args.job_id}")
    return 0


def add_job_commands(sub: Any) -> None:
    """``pipesvc job create|list|close``: from a running cluster to a job id (which
    ``status``, ``generate`` and ``trace`` take) and back."""
    job = sub.add_parser("job", help="create, list and close jobs on a running cluster")
    commands = job.add_subparsers(dest="job_command", required=True)
    _add_create_command(commands)

    p = commands.add_parser(
        "list", help="print the open jobs: id, model, step, stages, schedule, optimizer"
    )
    add_coordinator_flags(p, timeout_s=30.0)
    p.set_defaults(func=_cmd_job_list)

    p = commands.add_parser("close", help="close a job and free its stages")
    p.add_argument("job_id", metavar="ID", help="job id (from `job create` or `job list`)")
    add_coordinator_flags(p, timeout_s=60.0)
    p.set_defaults(func=_cmd_job_close)


def _add_create_command(commands: Any) -> None:
    """``pipesvc job create``: its flags are ``Client.create_job``'s keywords, with their
    defaults."""
    from pipesvc.client import Client

    def default(name: str) -> Any:
        return param_default(Client.create_job, name)

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
    _add_training_flags(p, default("loss"))
    p.add_argument("--partition", default=default("partition"), help="(default %(default)s)")
    p.add_argument("--precision", default=default("precision"), help="(default %(default)s)")
    p.add_argument("--seed", type=int, default=default("seed"), help="(default %(default)s)")
    _add_serving_flags(p)
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
    add_coordinator_flags(p, timeout_s=600.0)
    p.set_defaults(func=_cmd_job_create)


def _add_training_flags(p: argparse.ArgumentParser, loss: str) -> None:
    """How ``job create``'s job trains: its optimizer and learning rate, or none
    (``--inference``), and its ``loss`` (the default, ``Client.create_job``'s)."""
    from pipesvc.core.optim import DEFAULT_OPTIMIZER

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
        default=loss,
        help="cross_entropy, mse or causal_lm (default %(default)s; a Hugging Face causal LM "
        "trains with causal_lm)",
    )


def _add_serving_flags(p: argparse.ArgumentParser) -> None:
    """How ``job create``'s job serves: its name in the coordinator's HTTP API, the chunks
    of a long prompt's prefill and the decode steps of a run."""
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
        "--decode-steps",
        type=int,
        default=None,
        metavar="STEPS",
        help="generation: decode steps the stages run per run, the last stage handing each "
        "step's tokens to the first (default 4; 1: one step per run)",
    )


def add_generate_command(sub: Any) -> None:
    """Adds ``generate``."""
    p = sub.add_parser(
        "generate", help="stream text a job generates after a prompt (per-stage KV caches)"
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
    add_coordinator_flags(p, timeout_s=600.0)
    p.set_defaults(func=_cmd_generate)
