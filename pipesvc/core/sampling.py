"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p.

Pure: no gRPC. The order of the filters is ``transformers``' (temperature, then top-k, then
top-p), so the same settings mean the same distribution; with ``temperature == 0`` the choice
is the arg-max, as ``generate(do_sample=False)``. Sampling draws from one ``torch.Generator``
per session, seeded from ``seed``, over the whole batch at once, so a seeded session draws the
same tokens every time.

[Note: log-probabilities] A session that asks for log-probabilities gets, for each token it is
given, the token's log-probability and those of the ``top`` most likely tokens, under the
model's own distribution: ``log_softmax`` of the logits before temperature, top-k and top-p
(what vLLM reports by default), so the figures do not depend on how the token was drawn. They
come from the same float32 logits the choice is made from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipesvc.errors import InvalidArgumentError

MAX_TOP_LOGPROBS = 20
"""Most alternatives a session may ask the log-probabilities of, per token (OpenAI's limit)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    """How a session picks each token."""

    temperature: float = 0.0
    """0: greedy (the most likely token); above 0: sample from ``softmax(logits / t)``."""
    top_k: int | None = None
    """Sample only among the ``top_k`` most likely tokens."""
    top_p: float | None = None
    """Sample only among the most likely tokens whose probabilities sum to ``top_p``."""
    seed: int | None = None
    """Seed of the session's generator (None: a fresh random one)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError(
                f"temperature ({self.temperature}) must be a finite number >= 0"
            )
        if self.top_k is not None and self.top_k < 1:
            raise InvalidArgumentError(f"top_k ({self.top_k}) must be at least 1")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p ({self.top_p}) must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgumentError(f"seed ({self.seed}) must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        """Each token is the most likely one (``temperature == 0``)."""
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """The session's generator."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g

    def choose(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The next token of each row of ``logits`` (``[B, V]``) as a ``[B]`` int64 tensor."""
        logits = logits.float()
        if self.greedy:
            return logits.argmax(dim=-1)
        scores = logits / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = torch.sort(scores, dim=-1, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1 - self.top_p
            drop[..., -1] = False  # the most likely token always stays
            scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One step's log-probabilities, per row (see [Note: log-probabilities])."""

    chosen: torch.Tensor
    """``[B]`` float32: the log-probability of each row's token."""
    top_ids: torch.Tensor
    """``[B, top]`` int64: the most likely tokens, most likely first."""
    top: torch.Tensor
    """``[B, top]`` float32: their log-probabilities."""


def check_top_logprobs(top: int) -> None:
    """Raises InvalidArgumentError unless ``top`` is a count of alternatives a session may
    ask for."""
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(
            f"the number of top log-probabilities ({top!r}) must be an integer in "
            f"[0, {MAX_TOP_LOGPROBS}]"
        )


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> TokenLogprobs:
    """The log-probabilities of ``chosen`` (``[B]``) and of the ``top`` most likely tokens
    under ``logits`` (``[B, V]``)."""
    check_top_logprobs(top)
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    return TokenLogprobs(logp.gather(-1, chosen[:, None].long()).squeeze(-1), ids, values)
