"""Incremental detokenization (see [Note: incremental detokenization]): after every token, the
text is what decoding all of them gives, for a word-level tokenizer, a byte-level BPE whose
tokens split characters of several bytes, and a SentencePiece-style one that drops the first
token's leading space; and it decodes a bounded window, not everything so far."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipesvc.coordinator.serve_http.detokenizer import CONTEXT, IncrementalText
from tests.support.chat_model import word_tokenizer

CORPUS = [
    "Pipelines stream activations between hosts; ünïcödé, 日本語のテキスト, emoji 🙂🚀, ∑.",
    "The quick brown fox jumps over the lazy dog. Ça coûte 5 € — naïve café.",
] * 20


def byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def metaspace() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


TOKENIZERS = {"words": word_tokenizer, "byte-level": byte_level, "metaspace": metaspace}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("source", ["text", "random"])
def test_the_text_after_each_token_is_the_decoding_of_all_of_them(name: str, source: str) -> None:
    tokenizer = TOKENIZERS[name]()
    if source == "text":  # real text: characters split across tokens, then completed
        ids = tokenizer.encode(" ".join(CORPUS[:2])).ids
    else:  # any ids at all, incomplete characters left in the middle too
        rng = random.Random(7)
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(300)]
    text = IncrementalText(lambda part: str(tokenizer.decode(part)))
    sent = ""
    for n, token in enumerate(ids, start=1):
        sent += text.add(token)
        assert text.full == tokenizer.decode(ids[:n]), n
        assert sent == text.text and "\ufffd" not in text.text[-1:]
    assert text.text + text.pending == tokenizer.decode(ids)


def test_each_token_decodes_a_window_not_everything_before_it() -> None:
    tokenizer = word_tokenizer()
    longest = 0

    def decode(part: list[int]) -> str:
        nonlocal longest
        longest = max(longest, len(part))
        return str(tokenizer.decode(part))

    text = IncrementalText(decode)
    for token in [random.Random(3).randrange(40) for _ in range(500)]:
        text.add(token)
    assert longest == CONTEXT + 1
