"""Codecs on the wire, measured: their error by block size, and what they do to training.

``--blocks`` (pure, a few seconds): the relative RMS error of int8 and int4 (see [Note:
blockwise quantization] in ``pipesvc/core/quant.py``) on 4096 x 256 float32 tensors of four
kinds (Gaussian, ReLU'd Gaussian, Student-t with 3 degrees of freedom, Gaussian with every 64th
channel 20x larger), with the bytes per element each block size costs, scales included.

``--quality`` (the default): the built-in ``gpt`` of the demo (character level, 4 blocks of
width 128, on the pydoc text that ships with Python; AdamW as the demo, gradient clipping 1.0)
trained through pipesvc for ``--steps`` steps (300) on 2 stages that listen on two loopback
addresses of their own (``LocalCluster(separate_hosts=True)``), so their link is a link
between hosts and takes the job's codec (see [Note: codecs per link] in
``pipesvc/core/link_codecs.py``). Every run sees the same batches from the same seed. Rows:
float32 (the baseline), bfloat16, int8 and int4 on both roles, int8 and int4 activations with
bfloat16 gradients, and float32 again with the same batches in another order (``reordered``:
the noise floor, how far two runs that differ only by chance end apart). Columns: the final
training loss (the mean of the last 20 steps), the loss of the final weights on 16 held-out
batches (in one process, no codec: the model's quality), each with its ratio to float32's, and
the tensor bytes crossing the link per step (the codec's arithmetic on the activation's size;
the stages' ``pipesvc_bytes_total`` counters say the same). The curves, smoothed over 10
steps, go to ``--png`` (``bench-codecs.png``), their numbers to a JSON file beside it.

``--llama``: ``bench/hf.py``'s ~110M Llama (random, from its config) fine-tuned with LoRA for
``--steps`` (100) steps on the same text as bytes, the same codecs; the final training loss.

Usage: ``python bench/codecs.py [--blocks] [--steps 300] [--codecs float32,int8,...]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipesvc import models
from pipesvc.core import quant
from pipesvc.core.loss import compute_loss
from pipesvc.demo import OPTIMIZER, SEQUENCE_LENGTH, CharCorpus
from pipesvc.local_cluster import LocalCluster

RUNS: dict[str, str | dict[str, str] | None] = {
    "float32": None,
    "bfloat16": "bfloat16",
    "int8": "int8",
    "int4": "int4",
    "int8/bf16": {"activations": "int8", "gradients": "bfloat16"},
    "int4/bf16": {"activations": "int4", "gradients": "bfloat16"},
}
"""Row name -> ``wire_dtype`` (a row ``a/g`` sends activations in ``a``, gradients in ``g``)."""
TAIL = 20
"""Steps the final loss is averaged over."""
NOISE = " (reordered)"
"""The float32 row again with the same batches in another order: how far two runs that differ
only by chance end apart, the floor under which a codec's gap means nothing."""


def blocks() -> None:
    torch.manual_seed(0)
    kinds = {
        "gaussian": torch.randn(4096, 256),
        "relu": torch.relu(torch.randn(4096, 256)),
        "student-t(3)": torch.distributions.StudentT(3.0).sample((4096, 256)),
        "outlier channels": torch.randn(4096, 256)
        * torch.where(torch.arange(256) % 64 == 0, 20.0, 1.0),
    }
    sizes = (16, 32, 64, 128, 256)
    for codec in ("int8", "int4"):
        print(f"\n{codec}: relative RMS error by block size (bytes per element)")
        header = " | ".join(
            f"{b} ({quant.packed_bytes(4096 * 256, codec, b) / (4096 * 256):.3f} B)" for b in sizes
        )
        print(f"| tensor | {header} |")
        print("|---" * (len(sizes) + 1) + "|")
        for name, x in kinds.items():
            errors = []
            for b in sizes:
                y = quant.roundtrip(x, codec, b)
                errors.append(f"{float((y - x).norm() / x.norm()) * 100:.2f}%")
            print(f"| {name} | " + " | ".join(errors) + " |")


def _runs(
    cluster: LocalCluster,
    names: list[str],
    job: dict[str, Any],
    batches: dict[str, list[Any]],
    evaluate: Callable[[dict[str, torch.Tensor]], float] | None = None,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each named codec's losses over its ``batches``, one job each on ``cluster``, and with
    ``evaluate`` the held-out loss of the weights each ends with."""
    curves: dict[str, list[float]] = {}
    evals: dict[str, float] = {}
    with cluster.connect() as client:
        for name in names:
            codec = RUNS[name.removesuffix(NOISE)]
            with client.create_job(**job, wire_dtype=codec, checkpoint_every=0) as created:
                assert all(link.between_hosts for link in created.links), created.links
                started = time.perf_counter()
                curves[name] = list(created.train(batches[name], progress=sys.stderr.isatty()))
                took = time.perf_counter() - started
                if evaluate is not None:
                    evals[name] = evaluate(created.state_dict())
            print(f"{name}: {len(curves[name])} steps in {took:.0f} s", file=sys.stderr, flush=True)
    return curves, evals


def _final(losses: list[float]) -> float:
    """The mean of the last ``TAIL`` losses."""
    tail = losses[-TAIL:]
    return sum(tail) / len(tail)


def _report(
    title: str, curves: dict[str, list[float]], evals: dict[str, float], numel: int, png: str
) -> None:
    """The table of final losses (``numel``: elements of the activation crossing the link per
    step), the curves' PNG and their numbers as JSON beside it."""
    base = _final(curves["float32"]) if "float32" in curves else None
    base_eval = evals.get("float32")
    print(f"\n{title}")
    columns = "| codec (act/grad) | final train loss | x float32 |"
    if evals:
        columns += " held-out loss | x float32 |"
    print(columns + " MB/step sent |")
    print("|---" * (columns.count("|") - 1 + 1) + "|")
    for name, losses in curves.items():
        final = _final(losses)
        codecs = RUNS[name.removesuffix(NOISE)]
        act, grad = (
            (codecs, codecs)
            if not isinstance(codecs, dict)
            else (codecs["activations"], codecs["gradients"])
        )
        sent = sum(quant.wire_bytes(numel, c) if c else numel * 4 for c in (act, grad)) / 1e6
        cells = [name, f"{final:.4f}", f"{final / base:.4f}" if base else "-"]
        if evals:
            held = evals[name]
            cells += [f"{held:.4f}", f"{held / base_eval:.4f}" if base_eval else "-"]
        print("| " + " | ".join([*cells, f"{sent:.2f}"]) + " |")
    Path(png).with_suffix(".json").write_text(json.dumps({"curves": curves, "held_out": evals}))
    _plot(curves, png, title)
    print(f"\ncurves: {png} (and the numbers in {Path(png).with_suffix('.json')})")


def quality(steps: int, names: list[str], png: str) -> None:
    corpus = CharCorpus.from_python_docs()
    model_args = {
        "vocab_size": corpus.vocab_size,
        "block_size": SEQUENCE_LENGTH,
        "embed_dim": 128,
        "num_heads": 4,
        "num_blocks": 4,
    }
    batch, micro = 32, 8
    generator = torch.Generator().manual_seed(0)
    ordered = [corpus.batch(batch, generator) for _ in range(steps)]
    held_out = [corpus.batch(batch, torch.Generator().manual_seed(10**6)) for _ in range(16)]
    # The noise floor: float32 again, the same batches in another order.
    shuffled = [ordered[i] for i in torch.randperm(steps, generator=generator).tolist()]
    names = [*names, "float32" + NOISE] if "float32" in names else names
    batches = {name: shuffled if name.endswith(NOISE) else ordered for name in names}
    job = {
        "model": "gpt",
        "model_args": model_args,
        "seed": 0,
        "num_stages": 2,
        "num_microbatches": micro,
        "optimizer": OPTIMIZER,
        "loss": "cross_entropy",
        "partition": "parameters",
        "clip_grad_norm": 1.0,
    }

    def evaluate(weights: dict[str, torch.Tensor]) -> float:
        model = models.build("gpt", seed=0, **model_args)
        model.load_state_dict(weights)
        model.eval()
        with torch.no_grad():
            losses = [float(compute_loss("cross_entropy", model(x), y)) for x, y in held_out]
        return sum(losses) / len(losses)

    with LocalCluster(num_stages=2, separate_hosts=True) as cluster:
        curves, evals = _runs(cluster, names, job, batches, evaluate)
    _report(
        f"gpt on the pydoc text, 2 stages on two hosts, {steps} steps",
        curves,
        evals,
        batch * SEQUENCE_LENGTH * 128,
        png,
    )


def llama(steps: int, names: list[str], png: str) -> None:
    """``bench/hf.py``'s ~110M Llama (random, from its config) fine-tuned with LoRA (r 8 on
    the attention's q and v projections, AdamW lr 1e-3) on the pydoc text as bytes (token ids
    0-255), 8 rows of 128 tokens in 4 micro-batches, 2 stages on two hosts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.hf import CONFIG

    text = CharCorpus.from_python_docs()
    data = torch.tensor(list("".join(text.chars[i] for i in text.data.tolist()).encode()))
    generator = torch.Generator().manual_seed(0)
    rows, length, micro = 8, 128, 4
    batches = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - length - 1, (rows,), generator=generator)
        x = torch.stack([data[s : s + length] for s in starts.tolist()])
        batches.append((x, x.clone()))  # causal_lm shifts the labels itself
    with tempfile.TemporaryDirectory(prefix="pipesvc-bench-codecs-") as tmp:
        directory = str(Path(tmp) / "llama")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG))
        model.save_pretrained(directory)
        del model
        job = {
            "model": "bench-llama",
            "model_args": {
                "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
            },
            "loss": "causal_lm",
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "num_stages": 2,
            "num_microbatches": micro,
            "input_shape": [rows // micro, length],
            "input_dtype": "int64",
        }
        with LocalCluster(
            num_stages=2,
            threads_per_stage=1,
            separate_hosts=True,
            hf_models={"bench-llama": directory},
        ) as cluster:
            curves, _ = _runs(cluster, names, job, {name: batches for name in names})
    _report(
        f"~110M Llama, LoRA fine-tune on the pydoc bytes, 2 stages on two hosts, {steps} steps",
        curves,
        {},
        rows * length * int(CONFIG["hidden_size"]),
        png,
    )


def _plot(curves: dict[str, list[float]], png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for name, losses in curves.items():
        smooth = [
            sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
            for i in range(len(losses))
        ]
        axis.plot(range(1, len(losses) + 1), smooth, label=name)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss (mean of 10 steps)")
    axis.set_title(title, fontsize=10)
    axis.legend()
    figure.tight_layout()
    figure.savefig(png, format="png")
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", action="store_true", help="only the block-size table")
    parser.add_argument("--llama", action="store_true", help="the Llama LoRA run instead")
    parser.add_argument("--steps", type=int, help="default: 300 (gpt), 100 (--llama)")
    parser.add_argument("--codecs", default=",".join(RUNS), help=f"rows, of {', '.join(RUNS)}")
    parser.add_argument("--png", default="bench-codecs.png")
    args = parser.parse_args()
    if args.blocks:
        blocks()
        return
    names = [n.strip() for n in args.codecs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown codec row {unknown[0]!r}; expected some of {', '.join(RUNS)}")
    if args.llama:
        llama(args.steps or 100, names, args.png)
    else:
        quality(args.steps or 300, names, args.png)


if __name__ == "__main__":
    main()
