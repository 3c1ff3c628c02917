"""Streaming clients through the coordinator's OpenAI-compatible HTTP API, against the Python
client's sessions on the same job and ``transformers``' ``generate`` in one process.

Model: ``bench/generate.py``'s Llama (about 110M parameters; ``--quick``: the small one), saved
with a word-level tokenizer of its vocabulary (``t0``, ``t1``, ...) so the API can decode its
tokens; no end-of-sequence token, so every completion makes ``--new-tokens`` (default 32)
greedy tokens after its own prompt of 16 token ids.

- one process: ``bench/generate.py``'s baseline (``model.generate``, as many torch threads as
  stages): one prompt, and a batch of 16.
- python: ``Job.stream`` sessions, each from its own thread (as ``bench/generate.py``).
- http: the official ``openai`` client, ``completions.create(stream=True)`` with the prompt as
  token ids, each client from its own thread, against ``--http-port`` of the same coordinator.
  python and http take turns on the same job for each client count.

Columns: ``TTFT ms`` (mean time to the first token), ``TPOT ms`` (mean time per token after
it), ``tok/s`` (every client's tokens over the wall time from the first request to the last
token) and ``x first`` (tokens/s against the first row of the same block).

Prefix rows (``--prefix N``, default 1024; 0 skips them): HTTP requests, one at a time, whose
prompts are ``N`` shared token ids and 16 of their own. ``cold`` is a prompt whose start the
stages do not keep (a new random start each time, the time every request took before prefix
reuse), ``first`` the first request of a start, ``repeat`` each later request with the same
start and another tail (the stages keep its blocks; see [Note: prefix reuse]). ``x cold`` is
the time to the first token against cold's.

Long-prompt rows (``--long N``, default 2048; 0 skips them): a prompt of ``N`` random token ids
(no start kept: each new), one at a time through the Python client, on a job that prefills
whole prompts (``prefill_chunk=0``) and on one that prefills them in chunks (the default, see
[Note: chunked prefill]); ``x whole`` is the time to the first token against the whole
prompt's. ``beside a stream``: the same prompt asked for while another session streams (a
16-token prompt, 96 new tokens): its time to the first token, and the streaming session's
longest wait between two tokens (``gap ms``), which the whole prompt's prefill stretches and
chunks cut to about one chunk (see [Note: chunks between decode steps]). On one host the
stages share its cores, and a whole prompt's stages each take every core in turn (see [Note:
generation threads]); ``--generate-threads 1`` leaves each stage one core, as stages on hosts
of their own with a core each, where chunks overlap the stages.

Usage: ``python bench/serve.py [--quick] [--stages 2,4] [--clients 1,4,16] [--new-tokens 32]
[--prefix 1024] [--long 2048] [--generate-threads N]``
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pipesvc  # noqa: E402
from bench.generate import FULL, QUICK, one_process, prompts, row  # noqa: E402

Stream = Callable[[torch.Tensor, int], Iterator[object]]
"""Starts one streaming client on a prompt; yields once per new token."""


def save_model(directory: Path, config: dict[str, int]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    settings = AutoConfig.for_model("llama", **config, eos_token_id=None, bos_token_id=None)
    AutoModelForCausalLM.from_config(settings).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))


def clients(name: str, count: int, stream: Stream, new: int, vocab: int, base: float) -> float:
    """``count`` clients at once, one thread each; prints their row; returns tokens/s."""
    first = [0.0] * count
    per_token = [0.0] * count
    done = [0.0] * count
    made = [0] * count

    def client(i: int, ids: torch.Tensor, started: float) -> None:
        last, gaps = started, []
        for step, _ in enumerate(stream(ids, new)):
            now = time.perf_counter()
            if step == 0:
                first[i] = now - started
            else:
                gaps.append(now - last)
            last = now
            made[i] += 1
        per_token[i] = statistics.fmean(gaps) if gaps else 0.0
        done[i] = last

    started = time.perf_counter()
    threads = [
        threading.Thread(target=client, args=(i, ids, started))
        for i, ids in enumerate(prompts(count, vocab))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [new] * count, made
    tokens_per_s = count * new / (max(done) - started)
    row(
        name,
        statistics.fmean(first),
        statistics.fmean(per_token),
        tokens_per_s,
        base or tokens_per_s,
    )
    return tokens_per_s


def prefixed(api: object, length: int, new: int, vocab: int, rounds: int = 3) -> None:
    """The prefix rows: mean time to the first token of cold, first and repeat requests."""
    g = torch.Generator().manual_seed(7)

    def ttft(ids: torch.Tensor) -> float:
        started = time.perf_counter()
        chunks = api.completions.create(  # type: ignore[attr-defined]
            model="bench-llama", prompt=ids.tolist(), max_tokens=new, temperature=0, stream=True
        )
        first = None
        for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - started
        assert first is not None
        return first

    def prompt(start: torch.Tensor) -> torch.Tensor:
        return torch.cat([start, torch.randint(0, vocab, (16,), generator=g)])

    cold = [ttft(prompt(torch.randint(0, vocab, (length,), generator=g))) for _ in range(rounds)]
    start = torch.randint(0, vocab, (length,), generator=g)
    first = ttft(prompt(start))
    repeat = [ttft(prompt(start)) for _ in range(rounds)]
    base = statistics.mean(cold)
    for name, seconds in (("cold", base), ("first", first), ("repeat", statistics.mean(repeat))):
        print(f"{f'prefix {length}, {name}':<26} {seconds * 1e3:>9.1f} {'':>9} {'':>9} "
              f"{seconds / base:>9.2f}")  # fmt: skip


def long_rows(
    directory: Path,
    stages: int,
    length: int,
    vocab: int,
    rounds: int = 2,
    generate_threads: int | None = None,
) -> None:
    """The long-prompt rows: mean time to the first token, whole and in chunks; then the same
    prompt arriving while another session streams, and that session's longest wait for a token.
    ``generate_threads``: the stages' (None: ``LocalCluster``'s default, every core)."""
    g = torch.Generator().manual_seed(9)
    with (
        pipesvc.LocalCluster(
            num_stages=stages,
            threads_per_stage=1,
            generate_threads=generate_threads,
            hf_models={"bench-llama": directory},
        ) as cluster,
        cluster.connect() as client,
    ):
        print(f"{'run':<26} {'TTFT ms':>9} {'':>9} {'':>9} {'x whole':>9}")
        base = 0.0
        beside: list[tuple[str, float, float]] = []
        for name, chunk in (("whole", 0), ("chunks", None)):
            with client.create_job(
                model="bench-llama",
                optimizer=None,
                num_stages=stages,
                num_microbatches=1,
                prefill_chunk=chunk,
            ) as job:
                job.generate(torch.randint(0, vocab, (1, 64), generator=g), 1)  # warm-up
                times = []
                for _ in range(rounds):
                    ids = torch.randint(0, vocab, (1, length), generator=g)
                    started = time.perf_counter()
                    next(iter(job.stream(ids, 1)))
                    times.append(time.perf_counter() - started)
                ids = torch.randint(0, vocab, (1, length), generator=g)
                beside.append((name, *_beside_a_stream(job, ids, vocab, g)))
            seconds = statistics.mean(times)
            base = base or seconds
            print(f"{f'{stages} stages, {length}, {name}':<26} {seconds * 1e3:>9.1f} {'':>9} "
                  f"{'':>9} {seconds / base:>9.2f}")  # fmt: skip
        print(f"{'beside a stream':<26} {'TTFT ms':>9} {'gap ms':>9} {'':>9} {'gap x whole':>11}")
        for name, ttft, gap in beside:
            print(f"{f'{stages} stages, {length}, {name}':<26} {ttft * 1e3:>9.1f} "
                  f"{gap * 1e3:>9.1f} {'':>9} {gap / beside[0][2]:>11.2f}")  # fmt: skip


def _beside_a_stream(
    job: pipesvc.Job, ids: torch.Tensor, vocab: int, g: torch.Generator
) -> tuple[float, float]:
    """A session streams 96 tokens; after its 8th, ``ids`` asks for its first token. Returns
    that token's time, and the streaming session's longest wait between two of its tokens
    (see [Note: chunks between decode steps])."""
    arrived: list[float] = []
    reading = threading.Event()

    def read() -> None:
        for _ in job.stream(torch.randint(0, vocab, (1, 16), generator=g), 96):
            arrived.append(time.perf_counter())
            if len(arrived) == 8:
                reading.set()

    reader = threading.Thread(target=read)
    reader.start()
    reading.wait()
    started = time.perf_counter()
    next(iter(job.stream(ids, 1)))
    ttft = time.perf_counter() - started
    reader.join()
    gaps = [b - a for a, b in itertools.pairwise(arrived[8:])]
    return ttft, max(gaps)


def served(
    directory: Path, stages: int, counts: list[int], new: int, vocab: int, prefix: int = 0
) -> None:
    import openai

    with (
        pipesvc.LocalCluster(
            num_stages=stages,
            threads_per_stage=1,
            hf_models={"bench-llama": directory},
            coordinator_args=["--http-port", "0"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="bench-llama",
            optimizer=None,
            num_stages=stages,
            num_microbatches=1,
            name="bench-llama",
        ) as job,
    ):
        log = (cluster.log_dir / "coordinator.log").read_text()
        found = re.search(r"OpenAI-compatible API on (\S+)", log)
        assert found, "the coordinator serves no API"
        api = openai.OpenAI(base_url=found.group(1), api_key="none", max_retries=0)

        def python(ids: torch.Tensor, count: int) -> Iterator[object]:
            yield from job.stream(ids, count)

        def http(ids: torch.Tensor, count: int) -> Iterator[object]:
            chunks = api.completions.create(
                model="bench-llama",
                prompt=ids[0].tolist(),
                max_tokens=count,
                temperature=0,
                stream=True,
            )
            for chunk in chunks:
                # A chunk carries every token made at once (a run of decode steps): one
                # word of the bench's tokenizer each.
                if chunk.choices:
                    yield from chunk.choices[0].text.split()

        job.generate(prompts(1, vocab)[0], 2)  # warm-up
        list(http(prompts(1, vocab)[0], 2))
        bases = {"python": 0.0, "http": 0.0}
        for count in counts:
            for kind, stream in (("python", python), ("http", http)):
                name = f"{stages} stages, {kind}, {count}"
                tokens_per_s = clients(name, count, stream, new, vocab, bases[kind])
                bases[kind] = bases[kind] or tokens_per_s
        if prefix:
            print(f"{'run':<26} {'TTFT ms':>9} {'':>9} {'':>9} {'x cold':>9}")
            prefixed(api, prefix, new, vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=1024, help="shared prompt start (0: none)")
    parser.add_argument("--long", type=int, default=2048, help="long prompt (0: none)")
    parser.add_argument(
        "--generate-threads",
        type=int,
        default=None,
        help="the long-prompt rows' stages' threads for generation (default: every core; 1: "
        "a core a stage, as on hosts of their own)",
    )
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    # Room for the prefix rows' prompts (the start, 16 of their own, the new tokens).
    positions = max(
        config["max_position_embeddings"], args.prefix + 16 + args.new_tokens, args.long + 1
    )
    config = {**config, "max_position_embeddings": positions}
    counts = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        save_model(directory, config)
        print(f"{'run':<26} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>9} {'x first':>9}")
        for stages in (int(s) for s in args.stages.split(",")):
            one_process(str(directory), stages, args.new_tokens, config["vocab_size"])
            served(directory, stages, counts, args.new_tokens, config["vocab_size"], args.prefix)
            if args.long:
                long_rows(
                    directory,
                    stages,
                    args.long,
                    config["vocab_size"],
                    generate_threads=args.generate_threads,
                )


if __name__ == "__main__":
    main()
