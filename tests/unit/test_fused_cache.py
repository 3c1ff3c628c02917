"""Fused decode (see [Note: fused decode]): several sessions' decode steps as one micro-batch
through a model's real layers give each session's own step, and their caches cut back equal
the caches each would have grown alone. No stages: the layers run in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipesvc import models
from pipesvc.errors import InvalidArgumentError
from pipesvc.models.hf import register_hf_model
from pipesvc.stage.compute import fused_cache

VOCAB = 40


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(2)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("fused-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    register_hf_model("fused-llama", directory)
    return "fused-llama"


def run(net: torch.nn.Sequential, ids: torch.Tensor, mask: torch.Tensor, cache: Any) -> Any:
    """The model's layers on the new tokens ``ids`` (positions from ``mask``), through
    ``cache``; returns the last position's logits."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    side = {"attention_mask": mask, "position_ids": positions}
    x = ids
    for layer in net:
        wanted = {n: side[n] for n in getattr(layer, "side_inputs", ())}
        if getattr(layer, "uses_cache", False):
            wanted["cache"] = cache
        x = layer(x, **wanted)
    return x[:, -1]


def left_padded(lengths: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g)
    mask = torch.ones(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, : width - length] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_fused_decode_steps_equal_each_sessions_own(model: str, request: Any) -> None:
    name = request.getfixturevalue("hf_llama") if model == "hf" else "gpt"
    args: dict[str, Any] = {} if model == "hf" else {"vocab_size": VOCAB, "num_blocks": 2}
    net = models.build(name, seed=3, **args).eval()
    features = models.model_features(name, args)
    assert features.fuses_caches and features.new_cache is not None
    layout = features.cache_layout
    assert layout is not None
    g = torch.Generator().manual_seed(4)
    # Three sessions' parts: different prompt lengths and row counts, one with padding.
    prompts = [left_padded([5], g), left_padded([2, 3], g), left_padded([9, 9, 9], g)]
    alone, fused_parts, steps = [], [], []
    with torch.no_grad():
        for ids, mask in prompts:
            caches = [features.new_cache(), features.new_cache()]
            for cache in caches:
                run(net, ids, mask, cache)  # prefill
            new = torch.randint(1, VOCAB, (ids.shape[0], 1), generator=g)
            steps.append((new, torch.cat([mask, torch.ones_like(new)], dim=1)))
            alone.append((run(net, new, steps[-1][1], caches[0]), caches[0]))
            fused_parts.append(caches[1])
        rows = [ids.shape[0] for ids, _ in prompts]
        stacked = fused_cache.stack(layout, fused_parts, rows, [1] * len(rows))
        width = max(m.shape[1] for _, m in steps)
        mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for _, m in steps])
        ids = torch.cat([new for new, _ in steps])
        positions = torch.cat([(m.cumsum(-1) - 1)[:, -1:] for _, m in steps])
        x: Any = ids
        for layer in net:  # positions as the coordinator sends them: each row its own
            side = {"attention_mask": mask, "position_ids": positions}
            kwargs = {n: side[n] for n in getattr(layer, "side_inputs", ())}
            if getattr(layer, "uses_cache", False):
                kwargs["cache"] = stacked.cache
            x = layer(x, **kwargs)
        logits = x[:, -1]
        cut = stacked.split()
    row = 0
    for (expected, own_cache), part in zip(alone, cut, strict=True):
        rows = expected.shape[0]
        torch.testing.assert_close(logits[row : row + rows], expected, rtol=1e-5, atol=1e-5)
        row += rows
        ours, theirs = layout.tensors(part), layout.tensors(own_cache)
        assert len(ours) == 2 and set(ours) == set(theirs)  # one entry per block
        for key in ours:
            for a, b in zip(ours[key], theirs[key], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_fused_prompts_of_different_lengths_equal_each_prompt_alone(
    model: str, request: Any
) -> None:
    name = request.getfixturevalue("hf_llama") if model == "hf" else "gpt"
    args: dict[str, Any] = {} if model == "hf" else {"vocab_size": VOCAB, "num_blocks": 2}
    net = models.build(name, seed=3, **args).eval()
    features = models.model_features(name, args)
    layout = features.cache_layout
    assert layout is not None and features.new_cache is not None
    g = torch.Generator().manual_seed(6)
    prompts = [left_padded([4], g), left_padded([7, 5], g), left_padded([2, 2, 1], g)]
    width = max(ids.shape[1] for ids, _ in prompts)
    with torch.no_grad():
        alone = []
        for ids, mask in prompts:
            cache = features.new_cache()
            alone.append((run(net, ids, mask, cache), cache))
        empty = [features.new_cache() for _ in prompts]
        rows = [ids.shape[0] for ids, _ in prompts]
        stacked = fused_cache.stack(layout, empty, rows, [ids.shape[1] for ids, _ in prompts])

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (width - t.shape[1], 0))

        ids = torch.cat([pad(i) for i, _ in prompts])
        mask = torch.cat([pad(m) for _, m in prompts])
        logits = run(net, ids, mask, stacked.cache)
        cut = stacked.split()
    row = 0
    for (expected, own_cache), part in zip(alone, cut, strict=True):
        torch.testing.assert_close(
            logits[row : row + expected.shape[0]], expected, rtol=1e-5, atol=1e-5
        )
        row += expected.shape[0]
        ours, theirs = layout.tensors(part), layout.tensors(own_cache)
        assert set(ours) == set(theirs)
        for key in ours:
            for a, b in zip(ours[key], theirs[key], strict=True):
                assert a.shape == b.shape  # each part keeps exactly its own positions
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_caches_that_do_not_fit_together_are_refused() -> None:
    features = models.model_features("gpt", {"num_blocks": 2})
    layout = features.cache_layout
    assert layout is not None and features.new_cache is not None
    net = models.build("gpt", seed=0, num_blocks=2).eval()
    caches = [features.new_cache(), features.new_cache()]
    with torch.no_grad():
        run(net, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), caches[0])
        run(net, torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), caches[1])
    with pytest.raises(InvalidArgumentError, match=r"holds rows \[1\].*expected 2 rows"):
        fused_cache.stack(layout, caches, [2, 2], [1, 1])  # the second part holds one row
    with pytest.raises(InvalidArgumentError, match="caches layers"):
        fused_cache.stack(layout, [caches[0], features.new_cache()], [2, 1], [1, 1])
    stacked = fused_cache.stack(layout, caches, [2, 1], [1, 1])
    keys = next(iter(layout.tensors(stacked.cache).values()))[0]
    assert keys.shape[0] == 3 and keys.shape[2] == 4  # rows joined, lengths left-padded
    assert bool((keys[:2, :, :1] == 0).all())
    with pytest.raises(InvalidArgumentError, match="adds 1 in a fused run that added 0"):
        stacked.split()  # nothing ran: a part cannot keep a position that was never added


def test_a_sliding_window_model_does_not_fuse(tmp_path: Path) -> None:
    config = AutoConfig.for_model(
        "mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    register_hf_model("fused-mistral", tmp_path)
    assert not models.model_features("fused-mistral", {}).fuses_caches
