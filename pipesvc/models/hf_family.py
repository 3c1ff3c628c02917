"""Where the parts of each Hugging Face causal-LM family live in its ``transformers`` model.

Decoder-only families share one shape: token embeddings (plus learned positions in GPT-2), one
list of blocks, a final norm and the LM head. A family is an entry here, not new code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    """Where the parts of a family's ``...ForCausalLM`` live (attribute paths from the top)."""

    embed: str
    blocks: str
    norm: str
    head: str = "lm_head"
    positions: str | None = None
    """Learned position embeddings added to the token embeddings (GPT-2)."""
    dropout: str | None = None
    """Dropout after the embedding, if the family has one."""
    rotary: str | None = None
    """The rotary embedding module, called with (hidden states, position ids)."""
    stored: tuple[tuple[str, str], ...] = ()
    """(module path, older name in checkpoints): a tensor missing under the module's path is
    looked up under the older name (``transformers`` renames some parts on load)."""


def _llama_like(prefix: str = "model") -> Family:
    return Family(
        embed=f"{prefix}.embed_tokens",
        blocks=f"{prefix}.layers",
        norm=f"{prefix}.norm",
        rotary=f"{prefix}.rotary_emb",
    )


FAMILIES: dict[str, Family] = {
    "llama": _llama_like(),
    "mistral": _llama_like(),
    "qwen2": _llama_like(),
    "qwen3": _llama_like(),
    "gemma": _llama_like(),
    "olmo": _llama_like(),
    "phi": Family(
        embed="model.embed_tokens",
        blocks="model.layers",
        norm="model.final_layernorm",
        dropout="model.embed_dropout",
        rotary="model.rotary_emb",
    ),
    "gpt_neox": Family(
        embed="gpt_neox.embed_in",
        blocks="gpt_neox.layers",
        norm="gpt_neox.final_layer_norm",
        dropout="gpt_neox.emb_dropout",
        rotary="gpt_neox.rotary_emb",
        stored=(("lm_head", "embed_out"),),
    ),
    "gpt2": Family(
        embed="transformer.wte",
        positions="transformer.wpe",
        dropout="transformer.drop",
        blocks="transformer.h",
        norm="transformer.ln_f",
    ),
}
"""Supported ``model_type`` values of ``config.json``. Same-shaped families need only an entry."""
