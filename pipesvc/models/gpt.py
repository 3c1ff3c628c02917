"""The built-in ``gpt`` model: a small nanoGPT-style causal language model, one layer per piece.

Layers: ``Embedding`` (token + learned position), ``num_blocks`` pre-norm transformer
``Block``s, then ``Head`` (final LayerNorm + Linear to the vocabulary). Token and head weights
are not tied, so each layer owns its parameters and any range of layers can live on one stage.

Usage::

    import torch
    import torch.nn.functional as F
    from pipesvc import models

    net = models.build("gpt", seed=0, vocab_size=128, block_size=64, num_blocks=4)
    tokens = torch.randint(0, 128, (8, 33))
    logits = net(tokens[:, :-1])  # (8, 32, 128)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.registry import CacheLayout, CacheTensors, LayerSpec, register_model

INIT_STD = 0.02
"""Standard deviation of the normal init of Linear and Embedding weights (as in GPT-2)."""


def _init_linear_and_embedding(module: nn.Module, *, std: float = INIT_STD) -> None:
    for sub in module.modules():
        if isinstance(sub, nn.Linear | nn.Embedding):
            nn.init.normal_(sub.weight, mean=0.0, std=std)
        if isinstance(sub, nn.Linear) and sub.bias is not None:
            nn.init.zeros_(sub.bias)


class KVCache:
    """The keys and values of the blocks on one stage, for one part of a generation session
    (see [Note: generation sessions] in ``pipesvc.stage.compute.sessions``)."""

    def __init__(self) -> None:
        self._store: CacheTensors = {}

    def extend(
        self, owner: nn.Module, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``owner``'s new keys and values (``(B, heads, T, d)``); returns them all."""
        past = self._store.get(id(owner))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        self._store[id(owner)] = (k, v)
        return k, v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self._store.values() for t in kv)

    def tensors(self) -> CacheTensors:
        """Its keys and values by block (see ``CacheLayout``)."""
        return dict(self._store)

    @classmethod
    def from_tensors(cls, tensors: CacheTensors) -> KVCache:
        """A cache holding ``tensors`` (keyed as ``tensors()`` keys them)."""
        cache = cls()
        cache._store = dict(tensors)
        return cache


class Embedding(nn.Module):
    """Token + learned position embedding: LongTensor (B, T) with T <= block_size -> (B, T, C);
    in generation the new tokens' positions come as the ``position_ids`` side input."""

    side_inputs = ("position_ids",)

    def __init__(self, vocab_size: int, block_size: int, embed_dim: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.token = nn.Embedding(vocab_size, embed_dim)
        self.position = nn.Embedding(block_size, embed_dim)
        self.dropout = nn.Dropout(dropout)
        _init_linear_and_embedding(self)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Embeds token ids.

        Raises:
            InvalidArgumentError: ``idx`` is not 2-D or reaches past ``block_size``.
        """
        if idx.dim() != 2:
            raise InvalidArgumentError(f"gpt input must be (B, T), got shape {tuple(idx.shape)}")
        seq_len = idx.shape[1]
        if seq_len > self.block_size:
            raise InvalidArgumentError(
                f"gpt sequence length ({seq_len}) exceeds block_size ({self.block_size})"
            )
        pos = torch.arange(seq_len, device=idx.device)
        if position_ids is not None:
            end = int(position_ids.max()) + 1 if position_ids.numel() else 0
            if end > self.block_size:
                raise InvalidArgumentError(
                    f"gpt position {end - 1} is past block_size ({self.block_size})"
                )
            pos = position_ids
        x: torch.Tensor = self.dropout(self.token(idx) + self.position(pos))
        return x


def _attention_mask(
    length: int, past: int, padding: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Which keys each new position sees (``[B or 1, 1, T, past + T]``, True to attend): the
    cached ones and the new ones up to itself, less the padding (0 in ``padding``, ``[B,
    past + T]``), though always itself, so a padding row still has a key; None when plain
    causal attention is exactly that.

    Raises:
        InvalidArgumentError: ``padding`` does not cover the cached and the new positions.
    """
    if padding is None and not past:
        return None
    mask = torch.ones(length, past + length, dtype=torch.bool, device=device).tril(diagonal=past)
    if padding is None:
        return mask
    if padding.dim() != 2 or padding.shape[1] != past + length:
        raise InvalidArgumentError(
            f"attention_mask of shape {list(padding.shape)} after {past} cached positions; "
            f"expected [batch, {past + length}]"
        )
    keys = torch.arange(past + length, device=device)
    itself = keys[None, :] == (past + torch.arange(length, device=device))[:, None]
    return mask & (padding.to(device=device, dtype=torch.bool)[:, None, None, :] | itself)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, C) -> (B, T, C)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        # The attention dropout is drawn inside scaled_dot_product_attention, not by a module.
        self.uses_rng = dropout > 0
        # No bias: a key bias adds the same logit to every key, so softmax cancels it and its
        # gradient is zero up to rounding, which Adam would amplify into noise-driven updates.
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq_len, channels = x.shape
        # (B, T, 3C) -> three (B, heads, T, head_dim)
        q, k, v = (
            t.view(batch, seq_len, self.num_heads, -1).transpose(1, 2)
            for t in self.qkv(x).split(channels, dim=2)
        )
        if cache is not None:
            k, v = cache.extend(self, k, v)
        mask = _attention_mask(seq_len, k.shape[2] - seq_len, attention_mask, x.device)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq_len, channels)
        out: torch.Tensor = self.resid_dropout(self.proj(y))
        return out


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C), GELU, Linear(4C, C)."""

    def __init__(self, embed_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(embed_dim, 4 * embed_dim)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.proj(self.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); (B, T, C) -> (B, T, C)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float, num_blocks: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim)
        self.attn = CausalSelfAttention(embed_dim, num_heads, dropout)
        self.ln_2 = nn.LayerNorm(embed_dim)
        self.mlp = MLP(embed_dim, dropout)
        _init_linear_and_embedding(self)
        # GPT-2: scale the projections into the residual stream by depth.
        for proj in (self.attn.proj, self.mlp.proj):
            nn.init.normal_(proj.weight, mean=0.0, std=INIT_STD / math.sqrt(2 * num_blocks))

    uses_cache = True
    side_inputs = ("attention_mask",)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, attention_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class Head(nn.Module):
    """Final LayerNorm and projection to vocabulary logits: (B, T, C) -> (B, T, vocab_size)."""

    positionwise = True  # see [Note: last position only] in pipesvc.stage.compute.layer_calls

    def __init__(self, embed_dim: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(embed_dim)
        self.lm_head = nn.Linear(embed_dim, vocab_size, bias=False)
        _init_linear_and_embedding(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


@register_model("gpt")
def gpt(
    vocab_size: int = 128,
    block_size: int = 64,
    embed_dim: int = 64,
    num_heads: int = 4,
    num_blocks: int = 4,
    dropout: float = 0.0,
) -> list[LayerSpec]:
    """Returns the layers of a GPT: ``Embedding``, ``num_blocks`` x ``Block``, ``Head``.

    Raises:
        InvalidArgumentError: a size is not a positive integer, ``num_heads`` does not divide
            ``embed_dim``, or ``dropout`` is not in [0, 1).
    """
    sizes = {
        "vocab_size": vocab_size,
        "block_size": block_size,
        "embed_dim": embed_dim,
        "num_heads": num_heads,
        "num_blocks": num_blocks,
    }
    for key, value in sizes.items():
        if type(value) is not int or value <= 0:
            raise InvalidArgumentError(f"gpt: {key} ({value!r}) must be a positive integer")
    if embed_dim % num_heads:
        raise InvalidArgumentError(
            f"gpt: num_heads ({num_heads}) must divide embed_dim ({embed_dim})"
        )
    if type(dropout) not in (int, float) or not 0.0 <= dropout < 1.0:
        raise InvalidArgumentError(f"gpt: dropout ({dropout!r}) must be a number in [0, 1)")
    dropout = float(dropout)
    return [
        LayerSpec(Embedding, vocab_size, block_size, embed_dim, dropout),
        *(LayerSpec(Block, embed_dim, num_heads, dropout, num_blocks) for _ in range(num_blocks)),
        LayerSpec(Head, embed_dim, vocab_size),
    ]


def _new_cache(**_: object) -> type[KVCache]:
    return KVCache


def _cache_layout(**_: object) -> CacheLayout:
    return CacheLayout(tensors=KVCache.tensors, build=KVCache.from_tensors)


def _max_positions(block_size: int = 64, **_: object) -> int:
    return block_size


gpt.side_inputs = ("position_ids", "attention_mask")  # type: ignore[attr-defined]
gpt.new_cache = _new_cache  # type: ignore[attr-defined]
gpt.cache_layout = _cache_layout  # type: ignore[attr-defined]
gpt.max_positions = _max_positions  # type: ignore[attr-defined]
