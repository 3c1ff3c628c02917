"""Export: a trained pipesvc model written as a Hugging Face directory (or peft adapter) loads
back in transformers (and peft) with the logits the pipesvc layers compute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipesvc.errors import InvalidArgumentError
from pipesvc.models import registry
from pipesvc.models.hf import export_info, hf_layer_specs, model_keys
from pipesvc.models.hf_checkpoint import Checkpoint
from pipesvc.models.hf_export import merge_adapters, split_adapters, write_adapter, write_model
from tests.support.hf_families import CONFIGS, VOCAB

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def saved(model_type: str, directory: Path) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def trained_chain(directory: Path, lora: dict[str, Any] | None = None) -> torch.nn.Sequential:
    """The pipesvc layers with every trainable tensor moved, as training would."""
    specs = hf_layer_specs(directory, lora)
    chain = torch.nn.Sequential(
        *(registry.build_layer(s, seed=1, index=i) for i, s in enumerate(specs))
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in chain.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return chain.eval()


def model_state(chain: torch.nn.Sequential, directory: Path, lora: Any = None) -> dict[str, Any]:
    keys = model_keys(directory, lora)
    return {keys[k]: v for k, v in chain.state_dict().items()}


def config_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_an_exported_model_loads_with_the_same_logits(model_type: str, tmp_path: Path) -> None:
    source = saved(model_type, tmp_path / "source")
    chain = trained_chain(source)
    state = model_state(chain, source)
    info = export_info(source)
    out = tmp_path / "out"
    write_model(
        state, config_of(source), out, embed_key=info["embed_key"], head_key=info["head_key"],
        max_shard_bytes=40_000, layout=info["layout"],
    )  # fmt: skip
    assert (out / "model.safetensors.index.json").exists()  # sharded
    # The files name the tensors as save_pretrained does (per expert for mixture-of-experts
    # models; a tied head is written because the trained copies differ).
    written = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    published = set(Checkpoint(source).files)
    assert written - published <= {"lm_head.weight"} and published <= written
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert sorted(loaded.state_dict()) == sorted(state)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, chain(IDS))
    # Trained copies of a tied embedding and head differ: the export unties them.
    assert config_of(out).get("tie_word_embeddings", False) is False


def test_the_dtype_written_is_the_configs_or_the_one_asked(tmp_path: Path) -> None:
    source = saved("llama", tmp_path / "source")
    state = model_state(trained_chain(source), source)  # float32, as a job trains
    config = {**config_of(source), "dtype": "bfloat16"}
    keys = {"embed_key": "model.embed_tokens.weight", "head_key": "lm_head.weight"}
    write_model(state, config, tmp_path / "stored", **keys)
    write_model(state, config, tmp_path / "asked", **keys, dtype=torch.float16)
    for name, dtype in (("stored", torch.bfloat16), ("asked", torch.float16)):
        assert config_of(tmp_path / name)["dtype"] == str(dtype).removeprefix("torch.")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        for key, value in loaded.state_dict().items():
            assert value.dtype == dtype and torch.equal(value, state[key].to(dtype)), key
    with pytest.raises(InvalidArgumentError, match="dtype 'int8' is not one a model is written"):
        write_model(state, config, tmp_path / "refused", **keys, dtype="int8")
    assert not (tmp_path / "refused").exists()


def test_a_tied_model_whose_copies_agree_stays_tied(tmp_path: Path) -> None:
    source = saved("gpt2", tmp_path / "source")
    chain = trained_chain(source)
    with torch.no_grad():
        chain[-1].head.weight.copy_(chain[0].embed.weight)
    write_model(
        model_state(chain, source), config_of(source), tmp_path / "out",
        embed_key="transformer.wte.weight", head_key="lm_head.weight",
    )  # fmt: skip
    assert config_of(tmp_path / "out")["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, chain(IDS))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_exports_as_a_peft_adapter_and_merged(tmp_path: Path) -> None:
    from peft import PeftModel

    source = saved("llama", tmp_path / "source")
    chain = trained_chain(source, LORA)
    base, adapters = split_adapters(model_state(chain, source, LORA))
    assert len(adapters) == 4 * CONFIGS["llama"]["num_hidden_layers"]
    write_adapter(adapters, LORA, tmp_path / "adapter", base_model=str(source))
    with torch.no_grad():
        ours = chain(IDS)
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(source), tmp_path / "adapter"
        ).eval()
        assert torch.allclose(peft_model(IDS).logits, ours, atol=1e-5)
        merged = merge_adapters({**base, **adapters}, LORA)
        write_model(
            merged, config_of(source), tmp_path / "merged",
            embed_key="model.embed_tokens.weight", head_key="lm_head.weight",
        )  # fmt: skip
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert torch.allclose(loaded(IDS).logits, ours, atol=1e-5)
