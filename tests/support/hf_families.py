"""The Hugging Face families pipesvc is tested with: small configs built with ``from_config``.

One table for every test that checks a family against ``transformers`` (layers, training
through stages, generation, export) and for the README's list of tested families, which
``python -m tests.support.hf_families`` prints and ``tests/unit/test_readme.py`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VOCAB = 64
SMALL = {"vocab_size": VOCAB, "max_position_embeddings": 64}
_SIZES = {
    **SMALL, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


@dataclass(frozen=True)
class Tested:
    """One family as tested: what it exercises and its small config's fields."""

    what: str
    config: dict[str, Any] = field(default_factory=dict)
    named: bool = True
    """Named in the brief of families to support (False: a llama-shaped family that works
    without anyone having looked at it)."""
    generates: bool = True


TESTED: dict[str, Tested] = {
    "llama": Tested("grouped-query attention", {**_SIZES, "num_hidden_layers": 3}),
    "mistral": Tested("sliding-window attention", {**_SIZES, "sliding_window": 4}),
    "qwen2": Tested("multi-query attention, q/k/v biases", {**_SIZES, "num_key_value_heads": 1}),
    "qwen3": Tested("q/k norms", {**_SIZES, "head_dim": 8}),
    "gemma": Tested(
        "scaled embedding, tied head", {**_SIZES, "num_key_value_heads": 1, "head_dim": 8}
    ),
    "olmo": Tested("non-parametric layer norms", _SIZES),
    "phi": Tested("partial rotary, parallel attention and MLP, a head with a bias", _SIZES),
    "gpt_neox": Tested("a head stored under an older name (embed_out)", _SIZES),
    "gpt2": Tested(
        "learned positions, tied head",
        {
            "vocab_size": VOCAB,
            "n_positions": 64,
            "n_embd": 32,
            "n_layer": 3,
            "n_head": 4,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
    "phi3": Tested("fused qkv and gate/up projections", {**_SIZES, "pad_token_id": 0}),
    "gemma2": Tested(
        "alternating sliding and full attention, attention and final logit soft-capping",
        {**_SIZES, "num_hidden_layers": 3, "head_dim": 8, "sliding_window": 4},
    ),
    "gemma3_text": Tested(
        "a rotary table per attention kind, q/k norms, one full layer in 2",
        {
            **_SIZES,
            "num_hidden_layers": 3,
            "head_dim": 8,
            "sliding_window": 4,
            "sliding_window_pattern": 2,
        },
    ),
    "olmo2": Tested("norms after attention and MLP, q/k norms", _SIZES),
    "smollm3": Tested(
        "layers without rotary embeddings (NoPE), one in 2",
        {**_SIZES, "num_hidden_layers": 3, "pad_token_id": 0, "no_rope_layer_interval": 2},
    ),
    "mixtral": Tested(
        "mixture of experts, stored per expert under an older module name",
        {**_SIZES, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": Tested(
        "mixture of experts, stored per expert",
        {
            **_SIZES,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "head_dim": 8,
        },
    ),
    "gpt_oss": Tested(
        "mixture of experts stored stacked, attention sinks, alternating sliding windows",
        {
            **_SIZES,
            "intermediate_size": 48,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 8,
            "sliding_window": 4,
        },
    ),
    "llama4_text": Tested(
        "mixture of experts with a shared expert, chunked attention, layers without rotary",
        {
            **_SIZES,
            "num_hidden_layers": 3,
            "num_local_experts": 4,
            "intermediate_size_mlp": 64,
            "head_dim": 8,
            "attention_chunk_size": 4,
            "interleave_moe_layer_step": 1,
        },
    ),
    "deepseek_v3": Tested(
        "multi-head latent attention, a dense layer then mixture of experts",
        {
            **_SIZES,
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "qwen3_5_text": Tested(
        "hybrid linear attention (gated delta rule) with a full-attention layer in 2",
        {
            **_SIZES,
            "num_hidden_layers": 3,
            "head_dim": 8,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "full_attention_interval": 2,
        },
    ),
    "granite": Tested(
        "scaled embedding, residuals and logits",
        {**_SIZES, "logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0},
        named=False,
    ),
    "starcoder2": Tested("layer norms with biases", _SIZES, named=False),
    "cohere": Tested("parallel attention and MLP, scaled logits", _SIZES, named=False),
    "olmoe": Tested(
        "mixture of experts", {**_SIZES, "num_experts": 4, "num_experts_per_tok": 2}, named=False
    ),
    "exaone4": Tested("q/k norms, norms after attention and MLP", _SIZES, named=False),
    "seed_oss": Tested(
        "attention biases",
        {**_SIZES, "head_dim": 8, "attention_dropout": 0.0, "residual_dropout": 0.0},
        named=False,
    ),
}
"""Every family the tests check against ``transformers``, by ``model_type``."""

CONFIGS: dict[str, dict[str, Any]] = {name: family.config for name, family in TESTED.items()}


def markdown() -> str:
    """The README's table of tested families."""
    lines = ["| `model_type` | what its test exercises |", "|---|---|"]
    for name, family in TESTED.items():
        note = "" if family.named else " (recognised with no code naming it)"
        lines.append(f"| `{name}` | {family.what}{note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
