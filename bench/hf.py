"""A Hugging Face Llama-shaped model (~100M parameters, random, from a config) and a Mixtral-shaped
mixture of experts trained through pipesvc stages, against the same model trained in one process
with gradient accumulation.

Model: ``LlamaForCausalLM`` with vocabulary 32000, hidden 768, MLP 2048, 8 blocks, 12 heads
sharing 4 key/value heads (about 110M parameters, 440 MB in float32), saved with
``save_pretrained`` into a temporary directory and served by every stage with
``LocalCluster(hf_models={"bench-llama": DIR})``. Batch: 8 rows of 128 tokens in 4
micro-batches, ``causal_lm`` loss, AdamW (lr 1e-4), 1F1B, checkpoints off. ``--models
mixtral`` (in the default set) is ``MixtralForCausalLM`` with vocabulary 32000, hidden 512, 8
experts of MLP 1024 with 2 routed per token, 8 blocks, 8 heads sharing 4 key/value heads (about
135M parameters, every expert counted by the planner and held by its stage). ``--models
mixtral-aux`` is the same model with the router's auxiliary loss on (coefficient 0.02): its
routing statistics travel between the stages beside the activations.

- one process: ``AutoModelForCausalLM.from_pretrained(DIR)``, the same 4 micro-batches
  accumulated (each loss weighted by its share of the labels), one AdamW step; the process's
  peak RSS (``VmHWM``) from its own start.
- pipesvc: 2 and 4 stages (``LocalCluster(threads_per_stage=1)``; the one-process run gets as
  many torch threads as the cluster has stages, so both use the same cores); each stage's
  peak RSS, and the largest.

Steps/s is over the timed steps after one warm-up step. Each precision (``--precisions``,
default ``fp32,bf16-mixed``) is run both ways; the one-process ``bf16-mixed`` runs the model
under bfloat16 autocast with float32 weights and AdamW, as the stages do.

Usage: ``python bench/hf.py [--steps 3] [--stages 2,4] [--precisions fp32,bf16-mixed]
[--models llama,mixtral,mixtral-aux]``
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pipesvc  # noqa: E402
from pipesvc.core.loss import compute_loss, loss_units  # noqa: E402
from pipesvc.core.microbatch import loss_weights, split  # noqa: E402

MiB = 1 << 20
CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}
MOE_CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.02}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", CONFIG),
    "mixtral": ("mixtral", MOE_CONFIG),
    "mixtral-aux": ("mixtral", {**MOE_CONFIG, **AUX}),
}
BATCH, LENGTH, MICROBATCHES, LR = 8, 128, 4, 1e-4


def peak_rss(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, LENGTH), generator=g)
    return ids, ids.clone()


def one_process(directory: str, steps: int, threads: int, precision: str, out: Any) -> None:
    """Runs in a fresh process, so its peak RSS is its own."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    times = []
    for step in range(steps + 1):
        ids, labels = batch(step)
        started = time.perf_counter()
        optimizer.zero_grad()
        label_mbs = split(labels, MICROBATCHES)
        weights = loss_weights([loss_units("causal_lm", t) for t in label_mbs])
        for x, y, w in zip(split(ids, MICROBATCHES), label_mbs, weights, strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                result = model(x)
            loss = compute_loss("causal_lm", result.logits.float(), y)
            if getattr(result, "aux_loss", None) is not None:  # the config asks for it
                loss = loss + model.router_aux_loss_coef * result.aux_loss
            torch.autograd.backward(loss * w)
        optimizer.step()
        times.append(time.perf_counter() - started)
    out.put((steps / sum(times[1:]), peak_rss()))


def pipelined(
    directory: str, num_stages: int, steps: int, precision: str
) -> tuple[float, list[int]]:
    with (
        pipesvc.LocalCluster(
            num_stages=num_stages,
            threads_per_stage=1,
            hf_models={"bench-llama": directory},
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="bench-llama",
            loss="causal_lm",
            optimizer={"name": "adamw", "lr": LR},
            num_stages=num_stages,
            num_microbatches=MICROBATCHES,
            input_shape=[BATCH // MICROBATCHES, LENGTH],
            input_dtype="int64",
            checkpoint_every=0,
            precision=precision,
        ) as job,
    ):
        times = []
        for step in range(steps + 1):
            started = time.perf_counter()
            job.train_step(*batch(step))
            times.append(time.perf_counter() - started)
        return steps / sum(times[1:]), [peak_rss(pid) for pid in cluster.pids[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    parser.add_argument("--stages", default="2,4", help="stage counts (default 2,4)")
    parser.add_argument("--precisions", default="fp32,bf16-mixed", help="(default %(default)s)")
    parser.add_argument("--models", default="llama,mixtral", help="(default %(default)s)")
    args = parser.parse_args()
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"--models: {name!r} is not one of {', '.join(MODELS)}")
        model_type, config = MODELS[name]
        run_model(model_type, config, args)


def run_model(model_type: str, config: dict[str, Any], args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="pipesvc-bench-hf-") as tmp:
        directory = str(Path(tmp) / model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(directory)
        del model
        print(
            f"model: {model_type}, {params / 1e6:.0f}M parameters, batch {BATCH} x {LENGTH} "
            f"tokens in {MICROBATCHES} micro-batches, AdamW, {args.steps} timed steps"
        )
        print(f"{'precision':<11} {'run':<12} {'steps/s':>8} {'vs one':>7} {'peak RSS MiB':>20}")
        for precision in args.precisions.split(","):
            for num_stages in [int(s) for s in args.stages.split(",")]:
                ctx = multiprocessing.get_context("spawn")
                queue = ctx.Queue()
                child = ctx.Process(
                    target=one_process,
                    args=(directory, args.steps, num_stages, precision, queue),
                )
                child.start()
                base_rate, base_peak = queue.get()
                child.join()
                rate, peaks = pipelined(directory, num_stages, args.steps, precision)
                one = f"1 x {num_stages} thr"
                print(f"{precision:<11} {one:<12} {base_rate:>8.3f} {1.0:>7.2f} "
                      f"{base_peak / MiB:>20.0f}")  # fmt: skip
                cells = " ".join(f"{p / MiB:.0f}" for p in peaks)
                print(f"{precision:<11} {f'{num_stages} stages':<12} {rate:>8.3f} "
                      f"{rate / base_rate:>7.2f} {cells:>20}")  # fmt: skip


if __name__ == "__main__":
    main()
