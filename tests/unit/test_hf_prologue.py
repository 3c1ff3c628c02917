"""The blocks of one forward share the body's prologue (see [Note: shared prologue] in
pipesvc.models.hf_prologue): every family computes exactly what each block computes alone, with and
without a generation cache, and the body runs once for all the blocks where it may."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipesvc.models import hf_body, registry
from pipesvc.models.forward_scope import forward_scope
from pipesvc.models.hf import hf_layer_specs
from pipesvc.models.hf_cache import make_cache
from tests.support.hf_families import CONFIGS, VOCAB


def _layers(model_type: str, directory: Path) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], "num_hidden_layers": 3})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    specs = hf_layer_specs(directory)
    return [registry.build_layer(s, seed=0, index=i).eval() for i, s in enumerate(specs)]


def _forward(
    layers: list[torch.nn.Module], ids: torch.Tensor, mask: torch.Tensor, cache: Any
) -> torch.Tensor:
    """One stage holding every layer: the padding mask over the cached positions and the new
    ones, the new ones' positions."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    x = layers[0](ids, position_ids=positions)
    for block in layers[1:-1]:
        x = block(x, attention_mask=mask, position_ids=positions, cache=cache)
    out: torch.Tensor = layers[-1](x)
    return out


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_blocks_sharing_the_prologue_compute_what_each_computes_alone(
    model_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = _layers(model_type, tmp_path)
    blocks = len(layers) - 2
    runs: list[int] = []
    run = hf_body.run
    monkeypatch.setattr(hf_body, "run", lambda *a: runs.append(1) or run(*a))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0  # row 0 left-padded
    step = torch.randint(0, VOCAB, (2, 1), generator=g)
    longer = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)

    def generate(scoped: bool) -> tuple[list[torch.Tensor], list[int]]:
        cache = make_cache(str(tmp_path))
        outs, counts = [], []
        with torch.no_grad():
            for ids, m, c in ((prompt, mask, None), (prompt, mask, cache), (step, longer, cache)):
                runs.clear()
                if scoped:
                    with forward_scope():
                        outs.append(_forward(layers, ids, m, c))
                else:
                    outs.append(_forward(layers, ids, m, c))
                counts.append(len(runs))
        return outs, counts

    alone, alone_runs = generate(scoped=False)
    shared, shared_runs = generate(scoped=True)
    for a, b in zip(alone, shared, strict=True):
        assert torch.equal(a, b), model_type
    assert alone_runs == [blocks + 2] * 3
    # Without a cache the body runs once for every block (and once each for the embedding and
    # the head); with one, once too unless its layers are of several kinds.
    cache = make_cache(str(tmp_path))
    with torch.no_grad():
        _forward(layers, prompt, mask, cache)
    kinds = {type(layer) for layer in getattr(cache, "layers", [])}
    assert shared_runs[0] == 3
    assert shared_runs[1:] == ([3, 3] if len(kinds) <= 1 else [blocks + 2] * 2), kinds
