"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p.

Pure: no gRPC. The order of the filters is ``transformers``' (temperature, then top-k, then
top-p), so the same settings mean the same distribution; with ``temperature == 0`` the choice
is the arg-max, as ``generate(do_sample=False)``. Sampling draws from one ``torch.Generator``
per session, seeded from ``seed``, over the whole batch at once, so a seeded session draws the
same tokens every time.

[Note: sampling cost] A sampled token is chosen on the last stage once a decode step (see
[Note: sampling on the last stage] in ``pipesvc.coordinator.session``), for each row, so its
cost is paid per token on the pipeline's critical path. Over a 32000-word vocabulary the
obvious way (sort every probability for top-p, then ``torch.multinomial``) took 2.7 ms a row:
1.9 for the sort and 0.64 for ``multinomial``, which draws one exponential per word. Two
changes make it a fraction of that without changing the distribution:

- **top-p from candidates.** Top-p keeps a token while the probability of the tokens more
  likely than it is below ``top_p`` (``transformers``' rule, which it states as dropping the
  tail whose cumulative probability, summed from the least likely, is at most
  ``1 - top_p``). Only the most likely tokens can be kept, so the ``NUCLEUS_CANDIDATES`` most
  likely are taken with ``topk``; when their probability reaches ``top_p`` the kept ones are
  among them, and otherwise (a flat distribution) every probability is sorted, as before.
- **one uniform per row.** The token is drawn by inverting the cumulative distribution of
  the kept probabilities (float64) at one uniform number from the session's generator.

The same settings and seed draw the same tokens every time, on the coordinator and on the
last stage alike (both run ``Sampling.choose``); they are not the tokens the code before this
change drew for that seed, nor ``transformers``' for its seed, whose random streams differ.

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
NUCLEUS_CANDIDATES = 1024
"""The most likely tokens top-p looks among before it sorts them all (see [Note: sampling
cost])."""


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
        """The next token of each row of ``logits`` (``[B, V]``) as a ``[B]`` int64 tensor
        (see [Note: sampling cost])."""
        logits = logits.float()
        if self.greedy:
            return logits.argmax(dim=-1)
        uniform = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64)
        return draw(self.probabilities(logits), uniform)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution each row of ``logits`` (``[B, V]``) is sampled from: softmax of
        the logits over the temperature, with the tokens top-k and top-p leave out at 0 (the
        rest not renormalised)."""
        scores = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        probs = scores.softmax(dim=-1)
        if self.top_p is not None and self.top_p < 1.0:
            probs = probs * nucleus(probs, self.top_p)
        return probs


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens of each row of ``probs`` (``[B, V]``) top-p keeps, as a bool mask: those
    the tokens more likely than which sum to less than ``top_p`` (see [Note: sampling cost])."""
    count = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    values, order = torch.topk(probs, count, dim=-1)  # most likely first
    ordered = values.double()
    cumulative = ordered.cumsum(dim=-1)
    # The same sums decide both: a token past the candidates has them all above it.
    if count < probs.shape[-1] and bool((cumulative[..., -1] < top_p).any()):
        values, order = torch.sort(probs, dim=-1, descending=True)  # a flat row: all of them
        ordered = values.double()
        cumulative = ordered.cumsum(dim=-1)
    above = cumulative - ordered  # each candidate: the tokens more likely than it
    keep = above < top_p
    keep[..., 0] = True  # the most likely token always stays
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token (``[B]`` int64) from ``probs`` (``[B, V]``, not necessarily summing to
    1, no row all zero) at ``uniform`` (``[B, 1]`` float64 in [0, 1)): the first token whose
    cumulative probability exceeds ``uniform`` times the row's total, never one of
    probability 0."""
    cumulative = probs.double().cumsum(dim=-1)
    at = uniform * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, at, right=True).squeeze(-1)
    # Below the total, the first cumulative sum past ``at`` is a token's with probability.
    # Only an ``at`` rounded up to the total finds none (the row's width): then the last
    # token with any probability. Found only then: it costs a third of a draw.
    past = chosen >= probs.shape[-1]
    if bool(past.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        chosen = torch.where(past, last, chosen)
    return chosen


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
