"""Hugging Face causal LMs as pipesvc layers: equal to transformers' own forward and backward,
read by byte range from (sharded) safetensors checkpoints, with hostile directories refused."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from pipesvc.core.loss import compute_loss
from pipesvc.errors import InvalidArgumentError, NotFoundError
from pipesvc.models import registry
from pipesvc.models.hf import build_hf_layer, hf_layer_specs, register_hf_model, stored_names
from pipesvc.models.hf_checkpoint import SINGLE_FILE, Checkpoint
from pipesvc.models.lora import check_lora
from pipesvc.storage.weights import read_tensors, save_weights
from tests.support.hf_families import CONFIGS, VOCAB


def save_model(model_type: str, directory: Path, *, shard: str | None = None) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **CONFIGS[model_type])
    )
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return model.eval()


def chain(directory: Path) -> torch.nn.Sequential:
    specs = hf_layer_specs(directory)
    return torch.nn.Sequential(
        *(registry.build_layer(s, seed=0, index=i) for i, s in enumerate(specs))
    ).eval()


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_layers_equal_transformers_forward_and_backward(model_type: str, tmp_path: Path) -> None:
    hf = save_model(model_type, tmp_path, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded: several files
    ours = chain(tmp_path)
    assert len(ours) == hf.config.num_hidden_layers + 2
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    ours_logits, hf_logits = ours(ids), hf(ids).logits
    assert torch.equal(ours_logits, hf_logits)
    loss(ours_logits).backward()
    loss(hf_logits).backward()
    # Every parameter of ours has a twin in transformers' model with the same gradient; a tied
    # head's gradient is one part of the tied weight's, so the two parts must add up to it.
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    ckpt = Checkpoint(tmp_path)
    embed = [n for n in hf_grads if n == ckpt.family.embed_path + ".weight"]
    tied = bool(hf.config.tie_word_embeddings)
    for index, layer in enumerate(ours):
        for name, param in layer.named_parameters():
            assert param.grad is not None, (index, name)
            if tied and (index, name) == (0, "embed.weight"):
                continue  # checked with the head's below
            if tied and name == "head.weight":
                embed_grad = ours[0].embed.weight.grad
                assert torch.allclose(param.grad + embed_grad, hf_grads[embed[0]], atol=1e-6)
                continue
            twin = stored_names(ckpt, index, layer, reading=False)[name]
            assert torch.allclose(param.grad, hf_grads[twin], atol=1e-6), (index, name)


def test_a_stage_reads_only_its_own_layers_bytes(tmp_path: Path) -> None:
    # One file of ~4.2 MB; one block is ~1/6 of it. /proc/self/io counts bytes read by syscalls.
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    file_bytes = (tmp_path / SINGLE_FILE).stat().st_size
    specs = hf_layer_specs(tmp_path)
    registry.build_layer(specs[1], seed=0, index=1)  # config, header and skeleton: read once

    def bytes_read() -> int:
        io = Path(f"/proc/{os.getpid()}/io").read_text()
        return int(next(line for line in io.splitlines() if line.startswith("rchar:")).split()[1])

    before = bytes_read()
    block = registry.build_layer(specs[3], seed=0, index=3)
    read = bytes_read() - before
    block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    assert block_bytes <= read < block_bytes + 256 << 10, (read, block_bytes, file_bytes)
    assert read < file_bytes / 4


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_describing_reads_no_tensor_and_counts_every_parameter(
    model_type: str, tmp_path: Path
) -> None:
    # Every expert of a mixture-of-experts layer counts, whichever a token is routed to.
    hf = save_model(model_type, tmp_path)
    name = f"hf-describe-{model_type}"
    register_hf_model(name, tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pipesvc.models.hf_checkpoint.read_tensors", _refuse)
        described = registry.describe(name, {}, input_shape=[2, 5], input_dtype="int64")
    assert described.num_layers == hf.config.num_hidden_layers + 2
    assert sum(described.parameter_counts) == sum(p.numel() for p in hf.parameters())
    assert all(layer.activation_bytes > 0 for layer in described.layers)


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("describe read tensors")


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_bfloat16_checkpoint_builds_float32_layers_and_is_described_so(
    model_type: str, tmp_path: Path
) -> None:
    # Published checkpoints are stored in bfloat16 and their config says so; from_config would
    # build the skeleton in that dtype. The layers are float32 (what precision="fp32" trains),
    # equal to transformers loaded with dtype=float32, and the planner counts float32 bytes.
    hf = save_model(model_type, tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    ours = chain(tmp_path / "bf16")
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    assert {b.dtype for b in ours.buffers() if b.is_floating_point()} <= {torch.float32}
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(ids), reference.eval()(ids).logits)
    assert Checkpoint(tmp_path / "bf16").stored_dtype == "bfloat16"
    assert Checkpoint(tmp_path / "fp32").stored_dtype == "float32"
    described = {}
    for kind in ("fp32", "bf16"):
        register_hf_model(f"hf-stored-{model_type}-{kind}", tmp_path / kind)
        described[kind] = registry.describe(f"hf-stored-{model_type}-{kind}", {})
    params = sum(p.numel() for p in hf.parameters())
    for kind in ("fp32", "bf16"):
        layers = described[kind].layers
        assert sum(layer.parameter_bytes for layer in layers) >= 4 * params, kind
        assert [t.dtype for layer in layers for t in layer.tensors if t.dtype != "float32"] == []
    assert described["fp32"].layers == described["bf16"].layers


def test_the_stored_dtype_is_the_files_when_the_config_names_none(tmp_path: Path) -> None:
    hf = save_model("llama", tmp_path)
    hf.to(torch.float16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dtype"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert Checkpoint(tmp_path).stored_dtype == "float16"  # as transformers' dtype="auto"


def test_registering_the_same_directory_twice_is_allowed_another_is_not(tmp_path: Path) -> None:
    save_model("gpt_neox", tmp_path / "a")
    save_model("gpt_neox", tmp_path / "b")
    register_hf_model("hf-twice", tmp_path / "a")
    register_hf_model("hf-twice", tmp_path / "a")
    with pytest.raises(InvalidArgumentError, match="already registered"):
        register_hf_model("hf-twice", tmp_path / "b")
    with pytest.raises(InvalidArgumentError, match="must match"):
        register_hf_model("hf/../x", tmp_path / "a")


def test_bad_directories_are_refused_with_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        register_hf_model("hf-bad", tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(InvalidArgumentError, match="'t5' has no causal-LM class"):
        register_hf_model("hf-bad", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NotFoundError, match=r"neither model\.safetensors nor"):
        register_hf_model("hf-bad", tmp_path)
    index = {"weight_map": {"lm_head.weight": "../outside.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidArgumentError, match="expected a file name inside"):
        register_hf_model("hf-bad", tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidArgumentError, match="must hold a JSON object"):
        register_hf_model("hf-bad", tmp_path)
    assert "hf-bad" not in registry.known_models()


def test_a_model_of_another_shape_is_refused_with_what_does_not_fit(tmp_path: Path) -> None:
    # BERT has a causal-LM class, but its layers sit two levels down (bert.encoder.layer).
    config = AutoConfig.for_model(
        "bert", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, is_decoder=True,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(
        InvalidArgumentError, match=r"BertLMHeadModel \('bert'\) does not fit: expected one child "
        r"holding a list of num_hidden_layers=2 decoder layers; found 0",
    ):  # fmt: skip
        register_hf_model("hf-bert", tmp_path)
    assert "hf-bert" not in registry.known_models()


def test_a_body_that_unpacks_its_layers_outputs_is_refused(tmp_path: Path) -> None:
    # Falcon's body takes outputs[0] of each layer: stubs returning the hidden states show it.
    config = AutoConfig.for_model(
        "falcon", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=True, num_kv_heads=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(InvalidArgumentError, match="must pass each decoder layer's output"):
        register_hf_model("hf-falcon", tmp_path)
    assert "hf-falcon" not in registry.known_models()


def test_a_layer_index_outside_the_model_is_refused(tmp_path: Path) -> None:
    save_model("phi", tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"layer 9 is outside \[0, 3\]"):
        build_hf_layer(str(tmp_path.resolve()), 9)


def test_read_tensors_reads_the_named_tensors_only(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, 2], dtype=torch.int64),
        "c": torch.ones(4, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }
    save_weights(tensors, path)
    got = read_tensors(path, ["c", "a", "empty"])
    assert list(got) == ["c", "a", "empty"]
    for name, tensor in got.items():
        assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name])
    with pytest.raises(NotFoundError, match="holds no tensor 'z'"):
        read_tensors(path, ["a", "z"])
    data = path.read_bytes()
    path.write_bytes(data[:-4])  # the header still promises the last tensor's bytes
    with pytest.raises(InvalidArgumentError):
        read_tensors(path, ["a", "b", "c"])


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


# peft 0.21 with transformers 5 asks a deprecated property while wrapping the reference model.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_trains_only_the_adapters_and_equals_peft_in_one_process(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    hf = save_model("llama", tmp_path)
    specs = hf_layer_specs(tmp_path, LORA)
    ours = torch.nn.Sequential(
        *(registry.build_layer(s, seed=5, index=i) for i, s in enumerate(specs))
    )
    reference = get_peft_model(hf, LoraConfig(**LORA))  # type: ignore[arg-type]
    ckpt_names = {}  # ours (layer, local name) -> the peft model's name
    for index, layer in enumerate(ours):
        for name in dict(layer.named_parameters()):
            stored = stored_names(Checkpoint(tmp_path), index, layer)[name]
            ckpt_names[(index, name)] = f"base_model.model.{stored}"
    ref_params = dict(reference.named_parameters())
    trainable = {key for key, p in ref_params.items() if p.requires_grad}
    ours_trainable = {
        ckpt_names[(i, n)] for i, layer in enumerate(ours) for n, p in layer.named_parameters()
        if p.requires_grad
    }  # fmt: skip
    assert (
        ours_trainable == trainable and len(trainable) == 4 * CONFIGS["llama"]["num_hidden_layers"]
    )
    with torch.no_grad():  # the same initial adapters (ours come from the layer seeds)
        for (index, name), ref_name in ckpt_names.items():
            if "lora_" in name:
                ref_params[ref_name].copy_(ours[index].get_parameter(name))
    frozen_before = {
        k: p.detach().clone() for k, p in ours.named_parameters() if not p.requires_grad
    }
    ours_opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (2, 9), generator=g)
        losses = []
        for model, optimizer in ((ours, ours_opt), (reference, ref_opt)):
            optimizer.zero_grad()
            logits = model(ids) if model is ours else model(ids).logits
            loss = compute_loss("causal_lm", logits, ids)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (index, name), ref_name in ckpt_names.items():
        assert torch.allclose(ours[index].get_parameter(name), ref_params[ref_name], atol=1e-6)
    for key, value in ours.named_parameters():
        if key in frozen_before:
            assert value.grad is None and torch.equal(value, frozen_before[key])


def test_lora_arguments_are_checked() -> None:
    for bad, message in [
        ({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["x"]}, "not accepted"),
        ({"r": 0, "target_modules": ["q_proj"]}, "r .* must be an int"),
        ({"r": 4, "target_modules": []}, "non-empty list"),
        ({"r": 4, "target_modules": ["q"], "lora_dropout": 1.0}, r"must be in \[0, 1\)"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            check_lora(bad)
