"""Generation through pipesvc stages against ``transformers``' ``generate`` in one process.

Model: a Llama-shaped ``LlamaForCausalLM`` from a config (random weights, nothing downloaded):
vocabulary 32000, hidden 768, MLP 2048, 8 blocks, 12 heads sharing 4 key/value heads (about
110M parameters); ``--quick``: hidden 256, 4 blocks, vocabulary 8000. Every session generates
``--new-tokens`` (default 32) greedily after its own prompt of 16 tokens.

- one process: ``model.generate(do_sample=False)`` with ``--stages`` torch threads (the same
  cores the cluster's stages get, one thread each): one prompt, and a batch of 16 prompts.
- pipesvc: an inference job (``optimizer=None``) on ``LocalCluster(threads_per_stage=1)`` with
  2 and 4 stages; 1, 4 and 16 sessions at once, each from its own thread (``Job.stream``);
  a job for each of ``--decode-steps`` (its ``decode_steps``, the greedy decode steps a run
  takes on the stages: see [Note: decode steps on the stages] in ``pipesvc.coordinator.session``).

Columns: ``TTFT ms`` (time to first token, the mean over sessions: prompt to first new token),
``TPOT ms`` (time per output token after the first, the mean over sessions), ``tok/s`` (all
sessions' new tokens over the wall time from the first request to the last token), and
``x 1 session`` (tokens/s against one session of the same setup).

Usage: ``python bench/generate.py [--quick] [--stages 2,4] [--sessions 1,4,16]
[--decode-steps 1,4]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pipesvc  # noqa: E402

FULL = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}
QUICK = {**FULL, "vocab_size": 8000, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}  # fmt: skip
PROMPT = 16


def prompts(count: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, PROMPT), generator=g) for _ in range(count)]


def row(name: str, ttft: float, tpot: float, tokens_per_s: float, base: float) -> None:
    figures = f"{ttft * 1e3:9.1f} {tpot * 1e3:9.1f} {tokens_per_s:9.1f} {tokens_per_s / base:9.2f}"
    print(f"{name:<31} {figures}")


def one_process(directory: str, threads: int, new: int, vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model: Any = AutoModelForCausalLM.from_pretrained(directory).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    base = 0.0
    for count in (1, 16):
        ids = torch.cat(prompts(count, vocab))
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - started
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=new, do_sample=False)
            took = time.perf_counter() - started
        tokens_per_s = count * new / took
        base = base or tokens_per_s
        row(f"1 process, batch {count}", ttft, (took - ttft) / (new - 1), tokens_per_s, base)


def pipelined(
    directory: str, stages: int, sessions: list[int], new: int, vocab: int, decode_steps: int
) -> None:
    with (
        pipesvc.LocalCluster(
            num_stages=stages, threads_per_stage=1, hf_models={"bench-llama": directory}
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="bench-llama",
            optimizer=None,
            num_stages=stages,
            num_microbatches=1,
            decode_steps=decode_steps,
        ) as job,
    ):
        job.generate(prompts(1, vocab)[0], 2)  # warm-up
        base = 0.0
        for count in sessions:
            first: list[float] = [0.0] * count
            per_token: list[float] = [0.0] * count
            done: list[float] = [0.0] * count

            def session(
                i: int,
                ids: torch.Tensor,
                started: float,
                first: list[float] = first,
                per_token: list[float] = per_token,
                done: list[float] = done,
            ) -> None:
                last = started
                gaps = []
                for step, _ in enumerate(job.stream(ids, new)):
                    now = time.perf_counter()
                    if step == 0:
                        first[i] = now - started
                    else:
                        gaps.append(now - last)
                    last = now
                per_token[i] = statistics.fmean(gaps) if gaps else 0.0
                done[i] = last

            started = time.perf_counter()
            threads = [
                threading.Thread(target=session, args=(i, ids, started))
                for i, ids in enumerate(prompts(count, vocab))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            tokens_per_s = count * new / (max(done) - started)
            base = base or tokens_per_s
            row(
                f"{stages} stages, {count} sessions"
                + (f", k={decode_steps}" if decode_steps > 1 else ""),
                statistics.fmean(first),
                statistics.fmean(per_token),
                tokens_per_s,
                base,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--sessions", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--decode-steps",
        default="1,4",
        help="decode steps a run takes on the stages (the job's decode_steps), each a row",
    )
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    stages = [int(s) for s in args.stages.split(",")]
    sessions = [int(s) for s in args.sessions.split(",")]
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config)).save_pretrained(
            directory
        )
        print(f"{'run':<31} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>9} {'x first':>9}")
        for count in stages:
            one_process(directory, count, args.new_tokens, int(config["vocab_size"]))
            for k in (int(s) for s in args.decode_steps.split(",")):
                vocab = int(config["vocab_size"])
                pipelined(directory, count, sessions, args.new_tokens, vocab, k)


if __name__ == "__main__":
    main()
