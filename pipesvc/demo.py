"""The demo (``pipesvc demo``): a local cluster trains the built-in GPT on real text.

The corpus is the Python language reference and library topic help that ships with CPython
itself (``pydoc_data.topics``), so nothing is downloaded. The model is character-level.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch

from pipesvc import models
from pipesvc.client import Client, Job
from pipesvc.local_cluster import LocalCluster
from pipesvc.observe.trace import busy_idle, ideal_bubble
from pipesvc.wire.security import Security

SEQUENCE_LENGTH = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoOptions:
    """What the demo runs."""

    num_stages: int = 4
    """Stage processes (and pipeline stages)."""
    duration_s: float = 180.0
    """Training time budget."""
    max_steps: int = 0
    """Stop after this many steps (0: only the time budget)."""
    schedule: str = "1f1b"
    """Pipeline schedule."""
    batch_size: int = 32
    """Sequences per step."""
    num_microbatches: int = 8
    """Micro-batches per step."""
    seed: int = 0
    """Model and data seed."""
    trace_path: str = "pipesvc-demo-trace"
    """Stem of the trace files written at the end (``.json`` for Perfetto, ``.png``)."""
    coordinator: str | None = None
    """Train on this existing cluster (``host:port``) instead of starting a local one."""
    security: Security = field(default_factory=Security)
    """Token and TLS for that cluster."""


class CharCorpus:
    """The text as character ids, with random training windows."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @classmethod
    def from_python_docs(cls) -> CharCorpus:
        """The pydoc topics text that ships with Python."""
        from pydoc_data.topics import topics

        return cls("\n".join(topics[k] for k in sorted(topics)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` random windows and the same windows shifted by one (next-char targets)."""
        starts = torch.randint(
            0, len(self.data) - SEQUENCE_LENGTH - 1, (size,), generator=generator
        )
        x = torch.stack([self.data[s : s + SEQUENCE_LENGTH] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + 1 + SEQUENCE_LENGTH] for s in starts.tolist()])
        return x, y

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text if c in self.index]


def _bar(fraction: float, width: int = 24) -> str:
    filled = round(fraction * width)
    return "#" * filled + "-" * (width - filled)


def check_first_step(
    job: Job,
    model_args: dict[str, object],
    options: DemoOptions,
    optimizer: dict[str, object],
    x: torch.Tensor,
    y: torch.Tensor,
    pipeline_loss: float,
) -> tuple[float, float]:
    """Trains the whole model one step in this process; returns (|loss diff|, max |weight diff|)."""
    reference = models.build("gpt", seed=options.seed, **model_args)
    opt = torch.optim.AdamW(reference.parameters(), lr=float(optimizer["lr"]))  # type: ignore[arg-type]
    logits = reference(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    torch.autograd.backward(loss)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt.step()
    state = job.state_dict()
    weight_diff = max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items())
    return abs(float(loss.detach()) - pipeline_loss), weight_diff


def sample(job: Job, corpus: CharCorpus, prompt: str, length: int, seed: int) -> str:
    """Generates ``length`` characters after ``prompt`` through the pipeline's forward."""
    generator = torch.Generator().manual_seed(seed)
    ids = corpus.encode(prompt)
    for _ in range(length):
        context = torch.tensor([ids[-SEQUENCE_LENGTH:]], dtype=torch.long)
        logits = job.forward(context)[0, -1] / 0.8
        ids.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)))
    return corpus.decode(ids)


def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> dict[str, float]:
    """Runs the demo end to end and prints progress and a summary; returns the key figures."""
    corpus = CharCorpus.from_python_docs()
    model_args: dict[str, object] = {
        "vocab_size": corpus.vocab_size,
        "block_size": SEQUENCE_LENGTH,
        "embed_dim": 128,
        "num_heads": 4,
        "num_blocks": 4,
    }
    optimizer: dict[str, object] = {"name": "adamw", "lr": 3e-3}
    print(
        f"pipesvc demo: character-level GPT on Python's own docs ({len(corpus.data):,} chars, "
        f"{corpus.vocab_size} symbols)",
        file=out,
    )
    generator = torch.Generator().manual_seed(options.seed)
    with contextlib.ExitStack() as stack:
        if options.coordinator:
            print(f"using the cluster at {options.coordinator}", file=out, flush=True)
            client = Client(options.coordinator, security=options.security)
        else:
            print(
                f"starting a local cluster: 1 coordinator + {options.num_stages} stage processes",
                file=out,
                flush=True,
            )
            client = stack.enter_context(LocalCluster(num_stages=options.num_stages)).connect()
        stack.enter_context(client)
        job = client.create_job(
            model="gpt",
            model_args=model_args,
            seed=options.seed,
            num_stages=options.num_stages,
            num_microbatches=options.num_microbatches,
            schedule=options.schedule,
            optimizer=optimizer,
            loss="cross_entropy",
            partition="parameters",
            clip_grad_norm=1.0,
        )
        stack.enter_context(job)  # closed on the way out, also on errors
        print(
            f"job {job.id}: {job.num_layers} layers, schedule {options.schedule}, "
            f"{options.num_microbatches} micro-batches of {options.batch_size} x "
            f"{SEQUENCE_LENGTH} tokens",
            file=out,
        )
        for stage in job.plan:
            print(
                f"  rank {stage.rank}: layers [{stage.start_layer}, {stage.end_layer}) on "
                f"{stage.address}",
                file=out,
            )
        x, y = corpus.batch(options.batch_size, generator)
        first_loss = job.train_step(x, y)
        loss_diff, weight_diff = check_first_step(
            job, model_args, options, optimizer, x, y, first_loss
        )
        print(
            f"step 1 checked against one-process training: |loss diff| {loss_diff:.2e}, "
            f"max |weight diff| {weight_diff:.2e}",
            file=out,
            flush=True,
        )
        losses = [first_loss]
        tokens = options.batch_size * SEQUENCE_LENGTH
        start = time.monotonic()
        interactive = out.isatty()
        last_print = 0.0
        while True:
            elapsed = time.monotonic() - start
            steps = len(losses)
            if elapsed >= options.duration_s or (options.max_steps and steps >= options.max_steps):
                break
            x, y = corpus.batch(options.batch_size, generator)
            losses.append(job.train_step(x, y))
            elapsed = time.monotonic() - start
            smooth = sum(losses[-10:]) / len(losses[-10:])
            fraction = min(1.0, elapsed / options.duration_s)
            if options.max_steps:
                fraction = max(fraction, len(losses) / options.max_steps)
            line = (
                f"[{_bar(fraction)}] step {len(losses):4d}  loss {smooth:.3f}  "
                f"{tokens * (len(losses) - 1) / elapsed:,.0f} tokens/s  {elapsed:5.0f} s"
            )
            if interactive:
                print("\r" + line, end="", file=out, flush=True)
            elif elapsed - last_print >= 10:
                print(line, file=out, flush=True)
                last_print = elapsed
        if interactive:
            print(file=out)
        elapsed = time.monotonic() - start
        end_loss = sum(losses[-10:]) / len(losses[-10:])
        throughput = tokens * (len(losses) - 1) / max(elapsed, 1e-9)
        timelines = job.timelines(max_runs=3)
        trace_json, trace_png = job.trace(options.trace_path, max_runs=3)
        text = sample(job, corpus, "The ", 160, options.seed)
    summary = {
        "steps": float(len(losses)),
        "start_loss": first_loss,
        "end_loss": end_loss,
        "tokens_per_s": throughput,
        "first_step_weight_diff": weight_diff,
        "uniform_loss": math.log(corpus.vocab_size),
    }
    print("\nsummary", file=out)
    print(f"  steps          {len(losses)} in {elapsed:.0f} s", file=out)
    print(
        f"  loss           {first_loss:.3f} at start -> {end_loss:.3f} at end "
        f"(uniform guess: {summary['uniform_loss']:.3f})",
        file=out,
    )
    print(
        f"  throughput     {throughput:,.0f} tokens/s ({len(losses) / max(elapsed, 1e-9):.2f} "
        "steps/s)",
        file=out,
    )
    print(f"  step 1 check   max |weight diff| {weight_diff:.2e} vs one process", file=out)
    # Each step's own window (first to last event across stages), summed over the traced
    # steps: the time between steps (client, coordinator, commit) is not a pipeline bubble.
    traced_steps = sorted({e.step for t in timelines for e in t.events if e.step > 0})
    busy: dict[int, float] = {}
    idle: dict[int, float] = {}
    for traced in traced_steps:
        for rank, (b, i) in busy_idle(timelines, step=traced).items():
            busy[rank] = busy.get(rank, 0.0) + b
            idle[rank] = idle.get(rank, 0.0) + i
    ideal = ideal_bubble(options.num_stages, options.num_microbatches)
    print(
        "  bubble         "
        + ", ".join(
            f"rank {r} idle {idle[r] / max(busy[r] + idle[r], 1e-9):.0%}" for r in sorted(busy)
        )
        + f" (ideal {ideal:.0%}, last {len(traced_steps)} steps)",
        file=out,
    )
    print(f"  trace          {trace_json} (open in https://ui.perfetto.dev), {trace_png}", file=out)
    print(f"\nsample through the pipeline:\n{text}\n", file=out, flush=True)
    return summary
