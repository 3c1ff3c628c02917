"""A Hugging Face model larger than any one stage's budget loads and trains across stages, and
each stage's memory grows by about its own share of the model, not the whole of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc import models, register_hf_model
from pipesvc.core.loss import IGNORE_INDEX
from tests.support.stage_probe import stage_info

MIB = 2**20
# ~36M parameters: 144 MiB of float32 weights, 576 MiB with AdamW's gradients and two moments.
CONFIG = {
    "vocab_size": 8000, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64,
}  # fmt: skip
BUDGET = "320MiB"


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_model_no_stage_could_hold_trains_with_each_stage_near_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG))
    model.save_pretrained(tmp_path / "llama")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    whole = 4 * param_bytes  # weights, gradients, Adam's two moments
    monkeypatch.setenv("PIPESVC_TEST_HF_MODELS", f"hf-big={tmp_path / 'llama'}")
    with (
        pipesvc.LocalCluster(
            num_stages=3,
            threads_per_stage=1,
            models=["tests.support.models.hf_env"],
            stage_args=["--memory-budget", BUDGET],
        ) as cluster,
        cluster.connect() as client,
    ):
        stage_pids = cluster.pids[1:]
        before = {pid: status_kib(pid, "VmRSS") * 1024 for pid in stage_pids}
        options = {
            "model": "hf-big",
            "loss": "causal_lm",
            "optimizer": {"name": "adamw", "lr": 1e-4},
            "num_microbatches": 2,
            "input_shape": [2, 16],
            "input_dtype": "int64",
            "checkpoint_every": 0,
        }
        refused = r"layers \[0, 10\) needing about \d+ MiB.*it has 320 MiB"
        with pytest.raises(pipesvc.ResourceExhaustedError, match=refused):
            client.create_job(num_stages=1, **options)  # type: ignore[arg-type]
        with client.create_job(num_stages=3, partition="memory", **options) as job:  # type: ignore[arg-type]
            ids = torch.randint(0, CONFIG["vocab_size"], (4, 16))
            labels = ids.clone()
            labels[0, 10:] = IGNORE_INDEX
            first = job.train_step(ids, labels)
            second = job.train_step(ids, labels)
            assert second < first  # it trains
            # The peaks of loading and training, before streaming the state out adds its own.
            peaks = {s.address: status_kib(stage_info(s.address).pid, "VmHWM") for s in job.plan}
            # Each stage's share: its layers' parameter bytes, from the model's description.
            register_hf_model("hf-big", tmp_path / "llama")
            layers = models.describe("hf-big", {}).layers
            shares = {
                s.address: 4
                * sum(layer.parameter_bytes for layer in layers[s.start_layer : s.end_layer])
                for s in job.plan
            }
            for address, share in shares.items():
                grown = peaks[address] * 1024 - before[stage_info(address).pid]
                assert share < whole / 2, (share, whole)
                assert grown < share + 128 * MIB, (address, grown / MIB, share / MIB)
                assert grown < 0.75 * whole, (address, grown / MIB, whole / MIB)
            # With LoRA the whole model fits one such stage: frozen weights get no gradient
            # and no optimizer state, and the planner counts them so.
            pid = cluster.add_stage(["--memory-budget", BUDGET])
            fresh = status_kib(pid, "VmRSS") * 1024
            lora = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
            with client.create_job(
                num_stages=1, **{**options, "model_args": {"lora": lora}}
            ) as tuned:  # type: ignore[arg-type]
                assert stage_info(tuned.plan[0].address).pid == pid
                tuned.train_step(ids, labels)
                tuned.train_step(ids, labels)
                grown = status_kib(pid, "VmHWM") * 1024 - fresh
            assert grown < param_bytes + 96 * MIB, (grown / MIB, param_bytes / MIB)
