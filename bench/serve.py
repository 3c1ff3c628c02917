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
token) and ``x first`` (tokens/s against the first row of the same block). Prefix reuse and
chunked prefill (issue 27's other rows) are not built yet, so they are not measured here.

Usage: ``python bench/serve.py [--quick] [--stages 2,4] [--clients 1,4,16] [--new-tokens 32]``
"""

from __future__ import annotations

import argparse
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


def served(directory: Path, stages: int, counts: list[int], new: int, vocab: int) -> None:
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
                if chunk.choices and chunk.choices[0].text:
                    yield chunk

        job.generate(prompts(1, vocab)[0], 2)  # warm-up
        list(http(prompts(1, vocab)[0], 2))
        bases = {"python": 0.0, "http": 0.0}
        for count in counts:
            for kind, stream in (("python", python), ("http", http)):
                name = f"{stages} stages, {kind}, {count}"
                tokens_per_s = clients(name, count, stream, new, vocab, bases[kind])
                bases[kind] = bases[kind] or tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    counts = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        save_model(directory, config)
        print(f"{'run':<26} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>9} {'x first':>9}")
        for stages in (int(s) for s in args.stages.split(",")):
            one_process(str(directory), stages, args.new_tokens, config["vocab_size"])
            served(directory, stages, counts, args.new_tokens, config["vocab_size"])


if __name__ == "__main__":
    main()
