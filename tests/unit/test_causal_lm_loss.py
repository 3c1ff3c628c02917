"""The causal_lm loss: transformers' shifted, -100-ignoring mean, and micro-batch weights that
count tokens so unevenly padded micro-batches still give the whole batch's mean."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipesvc.core.loss import IGNORE_INDEX, compute_loss, loss_units
from pipesvc.core.microbatch import loss_weights, split
from pipesvc.errors import InvalidArgumentError

VOCAB = 32


def labelled_batch(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = ids.clone()
    # Uneven padding: row r ignores its last r labels (and the first row its first two).
    for r in range(rows):
        if r:
            labels[r, length - r :] = IGNORE_INDEX
    labels[0, :2] = IGNORE_INDEX
    return ids, labels


def test_equals_transformers_loss_with_labels() -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, labels = labelled_batch(4, 9, seed=1)
    with torch.no_grad():
        out = model(ids, labels=labels)
        ours = compute_loss("causal_lm", out.logits, labels)
    assert torch.allclose(ours, out.loss, atol=1e-6), (ours, out.loss)


def test_token_weighted_microbatches_give_the_whole_batch_mean() -> None:
    _, labels = labelled_batch(7, 8, seed=2)
    logits = torch.randn(7, 8, VOCAB, generator=torch.Generator().manual_seed(3))
    whole = compute_loss("causal_lm", logits, labels)
    for m in (2, 3, 7):
        label_mbs, logit_mbs = split(labels, m), split(logits, m)
        weights = loss_weights([loss_units("causal_lm", t) for t in label_mbs])
        rows = loss_weights([len(t) for t in label_mbs])
        total = sum(
            w * compute_loss("causal_lm", o, t)
            for w, o, t in zip(weights, logit_mbs, label_mbs, strict=True)
        )
        by_rows = sum(
            w * compute_loss("causal_lm", o, t)
            for w, o, t in zip(rows, logit_mbs, label_mbs, strict=True)
        )
        assert torch.allclose(total, whole, atol=1e-6), m
        assert not torch.allclose(by_rows, whole, atol=1e-4), m  # rows would be wrong here


def test_a_microbatch_with_nothing_to_predict_adds_zero_not_nan() -> None:
    logits = torch.randn(2, 5, VOCAB, requires_grad=True)
    labels = torch.full((2, 5), IGNORE_INDEX)
    loss = compute_loss("causal_lm", logits, labels)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None
    assert torch.count_nonzero(logits.grad) == 0
    assert loss_units("causal_lm", labels) == 0
    assert loss_weights([0, 0]) == [0.0, 0.0]


def test_shapes_and_dtypes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"logits \(B, T, V\) and labels \(B, T\)"):
        compute_loss("causal_lm", torch.randn(2, 5, VOCAB), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match="needs integer class targets"):
        compute_loss("causal_lm", torch.randn(2, 5, VOCAB), torch.zeros(2, 5))
