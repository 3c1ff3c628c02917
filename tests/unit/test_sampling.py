"""Sampling (see [Note: sampling cost] in pipesvc.core.sampling): the tokens top-k and top-p
keep are those ``transformers``' warpers keep, whether the candidates hold the nucleus or every
probability is sorted; a draw follows the distribution and never picks a token left out."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pipesvc.core import sampling
from pipesvc.core.sampling import Sampling, draw, nucleus


def _exact(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """transformers' rule in float64: after temperature and top-k, drop the least likely
    tokens whose cumulative probability, summed from the least likely, is at most
    ``1 - top_p``; keep the most likely always."""
    scores = logits.double() / s.temperature
    if s.top_k is not None:
        kth = torch.topk(scores, s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    kept = torch.isfinite(scores)
    if s.top_p is not None:
        ordered, order = torch.sort(scores, dim=-1)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - s.top_p
        drop[..., -1] = False
        kept &= ~drop.scatter(-1, order, drop)
    return kept


def _warped(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Which tokens ``transformers`` samples among, with the same settings in its order."""
    scores = TemperatureLogitsWarper(s.temperature)(None, logits.clone())  # type: ignore[arg-type]
    if s.top_k is not None:
        scores = TopKLogitsWarper(s.top_k)(None, scores)  # type: ignore[arg-type]
    if s.top_p is not None:
        scores = TopPLogitsWarper(s.top_p)(None, scores)  # type: ignore[arg-type]
    return torch.isfinite(scores)


@pytest.mark.parametrize("scale", [0.5, 1.0, 4.0, 12.0], ids=["flatter", "flat", "peaked", "sharp"])
@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.7, "top_p": 0.5},
        {"temperature": 1.3, "top_p": 0.99},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.8},
        {"temperature": 1.0, "top_k": 7},
    ],
)
def test_the_kept_tokens_are_transformers(scale: float, settings: dict[str, float]) -> None:
    """The tokens the rule keeps (computed in float64), and those transformers' float32
    warper keeps, but where float32 rounding decides the boundary: a token whose more likely
    tokens sum to ``top_p`` within float32's precision."""
    s = Sampling(**settings)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(int(scale * 10) + len(settings))
    logits = torch.randn(8, 5000, generator=g) * scale
    kept = s.probabilities(logits) > 0
    probs = (logits.double() / s.temperature).softmax(dim=-1)
    for reference in (_exact(logits, s), _warped(logits, s)):
        differ = kept != reference
        assert int(differ.sum(dim=-1).max()) <= 1
        for row, token in differ.nonzero().tolist():
            above = float(probs[row][probs[row] > probs[row, token]].sum())
            assert abs(above - (s.top_p or 1.0)) < 1e-5
    assert int((kept != _exact(logits, s)).sum()) <= 1  # over all 8 rows


def test_the_candidates_suffice_for_a_peaked_row_and_a_flat_one_sorts_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sorted_rows: list[int] = []
    sort = torch.sort

    def counted(*args: object, **kwargs: object) -> object:
        sorted_rows.append(args[0].shape[0])  # type: ignore[attr-defined]
        return sort(*args, **kwargs)  # type: ignore[call-overload]

    g = torch.Generator().manual_seed(5)
    peaked = (torch.randn(2, 32000, generator=g) * 8).softmax(-1)
    flat = torch.randn(2, 32000, generator=g).softmax(-1)
    s = Sampling(temperature=1.0, top_p=0.95)
    monkeypatch.setattr(sampling.torch, "sort", counted)
    kept = [nucleus(probs, 0.95) for probs in (peaked, flat)]
    monkeypatch.undo()
    for probs, found in zip((peaked, flat), kept, strict=True):
        assert torch.equal(found, _exact(probs.log(), s))
    # The flat rows' nucleus is more tokens than the candidates: only they sorted everything.
    assert int(kept[0].sum(-1).max()) < sampling.NUCLEUS_CANDIDATES
    assert int(kept[1].sum(-1).min()) > sampling.NUCLEUS_CANDIDATES
    assert sorted_rows == [2]


def test_a_draw_follows_the_distribution_and_never_picks_a_token_left_out() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    n = 20000
    for token in draw(probs.expand(n, 6), torch.rand(n, 1, generator=g, dtype=torch.float64)):
        counts[token] += 1
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts / n, probs[0], atol=0.015, rtol=0)
    # The ends of [0, 1): the first token with any probability, and the last, even where
    # the uniform times the total rounds up to the total.
    edges = torch.tensor([[0.0], [1.0 - 2**-53]], dtype=torch.float64)
    assert draw(probs.expand(2, 6), edges).tolist() == [1, 4]
    # Past the end (as a uniform times a total might round): still the last such token.
    assert draw(probs, torch.tensor([[1.0]], dtype=torch.float64)).tolist() == [4]


def test_a_seeded_session_draws_the_same_tokens_and_other_seeds_others() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2)) * 3
    s = Sampling(temperature=0.9, top_p=0.9, seed=11)
    first = [s.choose(logits, g) for g in [s.generator()] for _ in range(5)]
    again = [s.choose(logits, g) for g in [s.generator()] for _ in range(5)]
    other = Sampling(temperature=0.9, top_p=0.9, seed=12)
    drawn = [other.choose(logits, g) for g in [other.generator()] for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, drawn, strict=True))
