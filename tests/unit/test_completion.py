"""One completion of the HTTP API without a cluster: its settings as read from a request, and
which tokens' log-probabilities go out with which piece of text (see [Note: log-probabilities
over HTTP]); the session's steps are a generator here, the tokenizer the word-level one of
the API's test model."""

from __future__ import annotations

from collections.abc import Generator

import pytest
import torch

from pipesvc.coordinator.serve_http.completion import (
    BadRequest,
    Completion,
    Scored,
    read_settings,
)
from pipesvc.coordinator.serve_http.served_model import ModelText
from pipesvc.coordinator.session import Made
from pipesvc.core.sampling import token_logprobs
from tests.support.chat_model import EOS, WORDS, word_tokenizer


def model_text() -> ModelText:
    return ModelText(word_tokenizer(), None, {}, frozenset({EOS}), 0)


def logits_for(token: int) -> torch.Tensor:
    """Logits that make ``token`` the most likely, then the next ids in order."""
    logits = -torch.arange(len(WORDS), dtype=torch.float32)[None] / 4
    return logits.roll(token, dims=1)


def steps(tokens: list[int], top: int | None, run: int = 1) -> Generator[Made, None, None]:
    """Each token's step; in runs of ``run`` made at once (``more`` but on each run's last)."""
    for index, token in enumerate(tokens):
        chosen = torch.tensor([token])
        scored = token_logprobs(logits_for(token), chosen, top) if top is not None else None
        more = (index + 1) % run != 0 and index + 1 < len(tokens)
        yield Made(chosen, scored, more)


def run(
    tokens: list[int], *, stop: tuple[str, ...] = (), top: int | None = 2, steps_a_run: int = 1
) -> Completion:
    return Completion(steps(tokens, top, steps_a_run), model_text(), 3, 16, stop)


def streamed(completion: Completion) -> list[tuple[str, list[str]]]:
    """Each piece of text with the tokens that go out with it, as the stream sends them."""
    out = []
    while completion.finish_reason is None:
        piece = completion.step()
        scored = completion.take_logprobs()
        assert scored is not None
        out.append((piece, [s.text for s in scored]))
    return out


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def test_each_token_goes_out_with_its_text_and_none_after_a_stop_string() -> None:
    assert streamed(run(ids("w1 w2 w3 w4"))) == [
        ("w1", ["w1"]), (" w2", ["w2"]), (" w3", ["w3"]), (" w4", ["w4"]), ("", []),
    ]  # fmt: skip
    # "w2 w9" may start at "w2": that text is held back until "w3" shows it does not. Token
    # w2's text (" w2") starts at the space, which goes out, so w2 goes out with it.
    assert streamed(run(ids("w1 w2 w3 w4"), stop=("w2 w9",))) == [
        ("w1", ["w1"]), (" ", ["w2"]), ("w2 w3", ["w3"]), (" w4", ["w4"]), ("", []),
    ]  # fmt: skip
    # Held back from its start, a token waits with its text.
    assert streamed(run(ids("w1 w2 w3 w4"), stop=(" w2 w9",))) == [
        ("w1", ["w1"]), (" w2 w3", ["w2", "w3"]), (" w4", ["w4"]), ("", []),
    ]  # fmt: skip
    # The text stops before " w3": tokens w3 and w4 (made before the stop was seen) never go.
    whole = run(ids("w1 w2 w3 w4 w5"), stop=(" w3",))
    assert "".join(piece for piece, _ in streamed(whole)) == "w1 w2"
    assert whole.finish_reason == "stop"

    def reported(stop: str) -> list[tuple[str, int]]:
        completion = run(ids("w1 w2 w3 w4 w5"), stop=(stop,))
        while completion.finish_reason is None:
            completion.step()
        scored = completion.take_logprobs()
        assert scored is not None
        return [(s.text, s.offset) for s in scored]

    assert reported(" w3") == [("w1", 0), ("w2", 2)]
    # A stop string that begins inside a token's text: the token's start is in the text.
    assert reported("w3") == [("w1", 0), ("w2", 2), ("w3", 5)]


def test_tokens_made_at_once_go_out_as_one_piece_with_their_figures() -> None:
    """A run of several decode steps makes its tokens at once: ``step_with_ready`` hands them
    out as one piece (one chunk of a stream), each token's figures with it."""
    completion = run(ids("w1 w2 w3 w4 w5 w6"), steps_a_run=4)
    pieces = []
    while completion.finish_reason is None:
        piece = completion.step_with_ready()
        scored = completion.take_logprobs()
        assert scored is not None
        pieces.append((piece, [s.text for s in scored]))
    assert pieces == [
        ("w1 w2 w3 w4", ["w1", "w2", "w3", "w4"]), (" w5 w6", ["w5", "w6"]), ("", []),
    ]  # fmt: skip
    # A stop string inside a run ends the piece before it.
    completion = run(ids("w1 w2 w3 w4 w5 w6"), stop=(" w3",), steps_a_run=4)
    assert completion.step_with_ready() == "w1 w2" and completion.finish_reason == "stop"


def test_the_figures_are_the_models_log_softmax_and_an_eos_is_not_reported() -> None:
    completion = run([4, 7, EOS], top=3)
    while completion.finish_reason is None:
        completion.step()
    scored = completion.take_logprobs()
    assert scored is not None and completion.finish_reason == "stop"
    assert [s.text for s in scored] == ["w4", "w7"]
    first: Scored = scored[0]
    expected = torch.log_softmax(logits_for(4), dim=-1)[0]
    assert first.logprob == pytest.approx(float(expected[4]))
    assert [text for text, _ in first.top] == ["w4", "w5", "w6"]
    assert [v for _, v in first.top] == pytest.approx(expected[[4, 5, 6]].tolist())
    # A session that asked for none reports none.
    plain = run([4, 7], top=None)
    plain.step()
    assert plain.take_logprobs() is None


def test_requests_ask_for_log_probabilities_as_openai_names_them() -> None:
    assert read_settings({"logprobs": 3}, chat=False).logprobs == 3
    assert read_settings({"logprobs": 0}, chat=False).logprobs == 0
    assert read_settings({}, chat=False).logprobs is None
    assert read_settings({"logprobs": True, "top_logprobs": 5}, chat=True).logprobs == 5
    assert read_settings({"logprobs": True}, chat=True).logprobs == 0
    assert read_settings({"logprobs": False}, chat=True).logprobs is None
    refused = [
        ({"logprobs": 21}, False, "logprobs", r"logprobs \(21\) must be in \[0, 20\]"),
        ({"logprobs": -1}, False, "logprobs", "must be in"),
        ({"logprobs": "3"}, False, "logprobs", "must be an integer"),
        ({"top_logprobs": 2}, False, "top_logprobs", "not supported"),
        ({"echo": True, "logprobs": 1}, False, "echo", "not supported"),
        ({"top_logprobs": 2}, True, "top_logprobs", "needs logprobs set to true"),
        ({"logprobs": True, "top_logprobs": 30}, True, "top_logprobs", "must be in"),
        ({"logprobs": 1}, True, "logprobs", "must be true or false"),
    ]
    for body, chat, param, message in refused:
        with pytest.raises(BadRequest, match=message) as refusal:
            read_settings(body, chat=chat)
        assert refusal.value.param == param, body
