"""The demo (``pipesvc demo``): a local cluster trains the built-in GPT on real text.

The corpus is the Python language reference and library topic help that ships with CPython
itself (``pydoc_data.topics``), so nothing is downloaded. The model is character-level.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from pipesvc import models
from pipesvc.client import Client, Job
from pipesvc.core.schedule import ideal_bubble as schedule_bubble
from pipesvc.local_cluster import LocalCluster
from pipesvc.observe.trace import StageTimeline, busy_idle
from pipesvc.wire.security import Security

SEQUENCE_LENGTH = 64
LOG_EVERY_S = 10.0
"""Away from a terminal (a log, a pipe) the progress is one plain line this often."""


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
    keep_job: bool = False
    """Leave the job open at the end (for ``pipesvc generate``, ``trace``, ``job close``) and
    print its id; a local cluster then stays up until ``hold`` returns."""
    listen: str = "127.0.0.1:0"
    """Where the local cluster's coordinator listens."""


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


def _terminal_rows(out: TextIO) -> int:
    """The height of the terminal ``out`` writes to; 0 when it reports none or is no terminal."""
    try:
        return os.get_terminal_size(out.fileno()).lines
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return 0


class Progress:
    """The training loop's progress: steps against the expected total, with the step rate, the
    time left, the smoothed loss and tokens/s.

    On a terminal it is a live tqdm bar fitted to the terminal's width. Elsewhere (a log file, a
    pipe, a test's buffer) a bar redrawn with carriage returns would be one endless line, so it
    is a plain line every :data:`LOG_EVERY_S` seconds and one at the end, against the fixed
    limits (``max_steps``, the time budget) rather than the estimated total.

    The run stops at the time budget or at ``max_steps``, whichever comes first, so the expected
    total is the steps done plus those the current rate fits into the time left, capped at
    ``max_steps``; the estimated time left then follows both limits.
    """

    def __init__(
        self, out: TextIO, *, duration_s: float, max_steps: int, tokens_per_step: int
    ) -> None:
        self.out = out
        self.duration_s = duration_s
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.interactive = out.isatty()
        self.steps = 1  # the first step ran before the clock started (it is checked separately)
        self.elapsed = 0.0
        self.postfix = ""
        self._last_line_at = 0.0
        self._bar = tqdm(
            total=self._expected_total(),
            initial=self.steps,
            unit="step",
            file=out,
            # Fitted to the terminal's width as it changes; a terminal that reports no height
            # (some pseudo-terminals) would make tqdm hide the bar, so then it assumes one.
            dynamic_ncols=_terminal_rows(out) > 0,
            nrows=None if _terminal_rows(out) > 0 else 24,
            disable=not self.interactive,
        )

    def _expected_total(self) -> int:
        timed_steps = self.steps - 1
        if timed_steps and self.elapsed > 0:
            left_s = max(self.duration_s - self.elapsed, 0.0)
            total = self.steps + math.floor(timed_steps / self.elapsed * left_s)
        else:
            total = self.max_steps or self.steps
        return max(self.steps, min(total, self.max_steps) if self.max_steps else total)

    def update(self, *, steps: int, elapsed: float, loss: float) -> None:
        """Records that ``steps`` steps are done ``elapsed`` seconds after the first one."""
        advanced, self.steps, self.elapsed = steps - self.steps, steps, elapsed
        tokens_per_s = self.tokens_per_step * (steps - 1) / max(elapsed, 1e-9)
        self.postfix = f"loss {loss:.3f}, {tokens_per_s:,.0f} tokens/s"
        if self.interactive:
            self._bar.total = self._expected_total()
            self._bar.set_postfix_str(self.postfix, refresh=False)
            self._bar.update(advanced)
        elif elapsed - self._last_line_at >= LOG_EVERY_S:
            self._print_line()

    def _print_line(self) -> None:
        """A line for a log: only fixed limits in it (``max_steps``, the time budget), since
        an estimated total re-estimated at every line reads as a moving target."""
        self._last_line_at = self.elapsed
        steps = f"{self.steps}/{self.max_steps}" if self.max_steps else str(self.steps)
        rate = (self.steps - 1) / self.elapsed if self.elapsed > 0 else 0.0
        clock = tqdm.format_interval
        print(
            f"step {steps}, {clock(self.elapsed)} of {clock(self.duration_s)}, "
            f"{rate:.2f} steps/s, {self.postfix}",
            file=self.out,
            flush=True,
        )

    def close(self) -> None:
        """Ends the bar (leaving it on screen), or prints the last line."""
        if self.interactive:
            self._bar.close()
        elif self.steps > 1 and self._last_line_at < self.elapsed:
            self._print_line()


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
    """Generates ``length`` characters after ``prompt`` through the pipeline, with each stage's
    key/value caches (``Job.generate``). The model knows ``SEQUENCE_LENGTH`` positions, so a
    longer text goes on in windows: each starts from the last half window of characters."""
    ids = corpus.encode(prompt)
    window = 0
    while len(ids) - len(corpus.encode(prompt)) < length:
        context = ids[-(SEQUENCE_LENGTH // 2) :] if window else ids[-SEQUENCE_LENGTH:]
        left = length - (len(ids) - len(corpus.encode(prompt)))
        steps = max(1, min(left, SEQUENCE_LENGTH - len(context)))
        out = job.generate(
            torch.tensor([context], dtype=torch.long), steps, temperature=0.8, seed=seed + window
        )
        ids += out[0, len(context) :].tolist()
        window += 1
    return corpus.decode(ids)


GENERATE_EXAMPLE = '--prompt "def main(" --max-new-tokens 48 --temperature 0.8'
"""What the demo suggests to ``pipesvc generate`` on a kept job (as the README shows it): 9
characters and 48 new ones fit the model's 64 positions."""


def run_demo(
    options: DemoOptions, out: TextIO = sys.stdout, hold: Callable[[], object] = lambda: None
) -> dict[str, float]:
    """Runs the demo end to end and prints progress and a summary; returns the key figures.

    With ``options.keep_job`` the job stays open once the run succeeded and its id is printed;
    on a local cluster ``hold`` is then called while the cluster still runs (the command line
    waits there for Ctrl-C)."""
    corpus = CharCorpus.from_python_docs()
    model_args: dict[str, object] = {
        "vocab_size": corpus.vocab_size,
        "block_size": SEQUENCE_LENGTH,
        "embed_dim": 128,
        "num_heads": 4,
        "num_blocks": 4,
    }
    print(
        f"pipesvc demo: character-level GPT on Python's own docs ({len(corpus.data):,} chars, "
        f"{corpus.vocab_size} symbols)",
        file=out,
    )
    with contextlib.ExitStack() as stack:
        if options.coordinator:
            print(f"using the cluster at {options.coordinator}", file=out, flush=True)
            address = options.coordinator
            client = Client(address, security=options.security)
        else:
            print(
                f"starting a local cluster: 1 coordinator + {options.num_stages} stage processes",
                file=out,
                flush=True,
            )
            cluster = stack.enter_context(
                LocalCluster(num_stages=options.num_stages, listen=options.listen)
            )
            address, client = cluster.address, cluster.connect()
        stack.enter_context(client)
        job = client.create_job(
            model="gpt",
            model_args=model_args,
            seed=options.seed,
            num_stages=options.num_stages,
            num_microbatches=options.num_microbatches,
            schedule=options.schedule,
            optimizer=OPTIMIZER,
            loss="cross_entropy",
            partition="parameters",
            clip_grad_norm=1.0,
        )
        with contextlib.ExitStack() as owned:
            owned.enter_context(job)  # closed at the end, and on errors
            summary = _train(job, corpus, model_args, options, out)
            if options.keep_job:
                owned.pop_all()  # the run succeeded: the job stays open
        if options.keep_job:
            where = "" if options.coordinator is None else f" on {address}"
            print(
                f"job {job.id} kept open{where}; for example\n"
                f"  pipesvc generate --coordinator {address} --job {job.id} "
                f"{GENERATE_EXAMPLE}\n"
                f"  pipesvc job close --coordinator {address} {job.id}",
                file=out,
                flush=True,
            )
            if options.coordinator is None:
                print(
                    f"the local cluster at {address} keeps running until Ctrl-C",
                    file=out,
                    flush=True,
                )
                hold()
    return summary


OPTIMIZER: dict[str, object] = {"name": "adamw", "lr": 3e-3}


def _train(
    job: Job,
    corpus: CharCorpus,
    model_args: dict[str, object],
    options: DemoOptions,
    out: TextIO,
) -> dict[str, float]:
    """Trains ``job`` within the options' budget, checks step 1, writes the trace, samples
    text and prints the summary; returns the key figures."""
    generator = torch.Generator().manual_seed(options.seed)
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
    loss_diff, weight_diff = check_first_step(job, model_args, options, OPTIMIZER, x, y, first_loss)
    print(
        f"step 1 checked against one-process training: |loss diff| {loss_diff:.2e}, "
        f"max |weight diff| {weight_diff:.2e}",
        file=out,
        flush=True,
    )
    losses = [first_loss]
    tokens = options.batch_size * SEQUENCE_LENGTH
    progress = Progress(
        out,
        duration_s=options.duration_s,
        max_steps=options.max_steps,
        tokens_per_step=tokens,
    )
    start = time.monotonic()
    with contextlib.closing(progress):
        while True:
            elapsed = time.monotonic() - start
            steps = len(losses)
            if elapsed >= options.duration_s or (options.max_steps and steps >= options.max_steps):
                break
            x, y = corpus.batch(options.batch_size, generator)
            losses.append(job.train_step(x, y))
            smooth = sum(losses[-10:]) / len(losses[-10:])
            progress.update(steps=len(losses), elapsed=time.monotonic() - start, loss=smooth)
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
    _print_summary(out, summary, elapsed, timelines, options)
    print(f"  trace          {trace_json} (open in https://ui.perfetto.dev), {trace_png}", file=out)
    print(f"\nsample through the pipeline:\n{text}\n", file=out, flush=True)
    return summary


BUBBLE_LEGEND = (
    "                 idle: the share of each step's window (first to last action on any\n"
    "                 stage) in which that rank ran nothing, waiting for a neighbour or a CPU;\n"
    "                 ideal: the schedule's own bubble if every action took the same time\n"
    "                 ((p-1)/(m+p-1) for GPipe and 1F1B, p stages, m micro-batches)"
)
"""What the summary's idle shares mean, printed under them."""


def _print_summary(
    out: TextIO,
    summary: dict[str, float],
    elapsed: float,
    timelines: list[StageTimeline],
    options: DemoOptions,
) -> None:
    """The run's summary: steps, loss, throughput, step 1's check and each rank's idle share
    of the traced steps."""
    steps = int(summary["steps"])
    start, end, uniform = summary["start_loss"], summary["end_loss"], summary["uniform_loss"]
    per_s = steps / max(elapsed, 1e-9)
    print("\nsummary", file=out)
    print(f"  steps          {steps} in {elapsed:.0f} s", file=out)
    print(
        f"  loss           {start:.3f} at start -> {end:.3f} at end (uniform guess: {uniform:.3f})",
        file=out,
    )
    print(
        f"  throughput     {summary['tokens_per_s']:,.0f} tokens/s ({per_s:.2f} steps/s)",
        file=out,
    )
    print(
        f"  step 1 check   max |weight diff| {summary['first_step_weight_diff']:.2e} vs one "
        "process",
        file=out,
    )
    # Each step's own window (first to last event across stages), summed over the traced
    # steps: the time between steps (client, coordinator, commit) is not a pipeline bubble.
    traced_steps = sorted({e.step for t in timelines for e in t.events if e.step > 0})
    busy: dict[int, float] = {}
    idle: dict[int, float] = {}
    for traced in traced_steps:
        for rank, (b, i) in busy_idle(timelines, step=traced).items():
            busy[rank] = busy.get(rank, 0.0) + b
            idle[rank] = idle.get(rank, 0.0) + i
    ideal = schedule_bubble(
        options.schedule, num_stages=options.num_stages, num_microbatches=options.num_microbatches
    )
    print(
        "  bubble         "
        + ", ".join(
            f"rank {r} idle {idle[r] / max(busy[r] + idle[r], 1e-9):.0%}" for r in sorted(busy)
        )
        + f" (ideal {ideal:.0%}, last {len(traced_steps)} steps)",
        file=out,
    )
    print(BUBBLE_LEGEND, file=out)
