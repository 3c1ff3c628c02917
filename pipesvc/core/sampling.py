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


GENERATOR_STATE_BYTES = int(torch.Generator().get_state().numel())
"""The bytes of a CPU ``torch.Generator``'s state (``get_state``)."""


@dataclass(frozen=True, slots=True)
class RowsSampling:
    """How one session's rows of a fused micro-batch pick their tokens on the last stage, in
    a run of several decode steps (see [Note: sampling on the last stage] in
    ``pipesvc.coordinator.session``)."""

    rows: tuple[tuple[int, int], ...]
    """``[start, end)`` row ranges of the micro-batch, in the order of the session's parts."""
    sampling: Sampling
    state: bytes = b""
    """The session's generator state before the run (empty when greedy)."""


def generator_from(state: bytes) -> torch.Generator:
    """A CPU generator in ``state`` (``get_state`` bytes).

    Raises:
        InvalidArgumentError: not a generator state.
    """
    if len(state) != GENERATOR_STATE_BYTES:
        raise InvalidArgumentError(
            f"a generator state of {len(state)} bytes; expected {GENERATOR_STATE_BYTES}"
        )
    generator = torch.Generator()
    try:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except RuntimeError as exc:
        raise InvalidArgumentError(f"the generator state does not load: {exc}") from exc
    return generator


def generator_state(generator: torch.Generator) -> bytes:
    """``generator``'s state as bytes (what ``generator_from`` takes)."""
    return bytes(generator.get_state().numpy().tobytes())


def check_rows(plans: list[RowsSampling], num_rows: int) -> None:
    """Raises InvalidArgumentError unless ``plans``' row ranges cover ``num_rows`` rows,
    each once."""
    covered = sorted(r for plan in plans for r in plan.rows)
    at = 0
    for start, end in covered:
        if start != at or end <= start:
            break
        at = end
    else:
        if at == num_rows:
            return
    raise InvalidArgumentError(
        f"sampling row ranges {covered} must cover the micro-batch's {num_rows} rows, each "
        "once, every range non-empty"
    )


def choose_rows(
    logits: torch.Tensor, plans: list[RowsSampling], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Each row's next token (``[R]`` int64) from ``logits`` (``[R, V]``), each session's rows
    chosen together as the coordinator chooses them (``Sampling.choose`` over the session's
    rows in its parts' order, with its generator)."""
    chosen = torch.empty(logits.shape[0], dtype=torch.long)
    for plan, generator in zip(plans, generators, strict=True):
        index = torch.cat([torch.arange(a, b) for a, b in plan.rows])
        if generator is None:
            chosen[index] = logits[index].float().argmax(dim=-1)
        else:
            chosen[index] = plan.sampling.choose(logits[index], generator)
    return chosen
