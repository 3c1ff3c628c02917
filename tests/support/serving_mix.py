"""Sessions of every kind for a serving test, drawn from a seed, and the oracle that checks
each of their tokens against the model in one process (see the tests that use it:
``tests/integration/test_serving_mix.py`` and ``tests/cluster/test_serving_mix_faults.py``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.coordinator.prefixes import BLOCK

VOCAB = 64
TOLERANCE = 1e-4
"""How far below the row's largest logit (in the one-process model) a chosen token's logit
may be: float rounding of a fused batch, never a different token's lead."""
SYSTEM = 2 * BLOCK + 3
CHUNK = 32


def save_model(directory: Path) -> None:
    """The scenarios' model: a small Llama with room for long prompts."""
    torch.manual_seed(3)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


@dataclass
class Request:
    """One session: its prompt rows (left-padded) and settings, and what it produced."""

    kind: str
    ids: torch.Tensor
    mask: torch.Tensor
    new: int
    delay_s: float
    options: dict[str, Any] = field(default_factory=dict)
    close_after: int | None = None
    follow_up: torch.Tensor | None = None
    """A chat's next turn: this tail is appended to the prompt and the answer, and sent as a
    session of its own once this one ended (one row only)."""
    tokens: list[torch.Tensor] = field(default_factory=list)
    """New tokens per step, each ``[rows]``."""


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def draw_requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(1, VOCAB, (n,), generator=g)

    system = tokens(SYSTEM)
    requests = []
    kinds = ["shared", "turn", "long", "rows", "sampled", "eos", "closed"] * 3 + ["shared"] * 3
    rng.shuffle(kinds)
    for kind in kinds:
        new = rng.randint(1, 40)
        delay = rng.uniform(0.0, 0.6)
        if kind in ("shared", "turn", "eos", "closed", "sampled"):
            ids, mask = left_padded([torch.cat([system, tokens(rng.randint(1, 20))])])
        elif kind == "long":
            ids, mask = left_padded([tokens(rng.randint(3 * CHUNK, 6 * CHUNK))])
        else:  # rows: uneven prompts in one session, some sharing the system prompt
            rows = [
                torch.cat([system, tokens(rng.randint(1, 9))]) if rng.random() < 0.5
                else tokens(rng.randint(1, 40))
                for _ in range(rng.randint(2, 3))
            ]  # fmt: skip
            ids, mask = left_padded(rows)
        request = Request(kind, ids, mask, new, delay)
        if kind == "sampled":
            request.options = {
                "temperature": rng.choice([0.7, 1.0, 1.3]), "top_k": rng.randint(2, 6),
                "top_p": rng.choice([None, 0.9]), "seed": rng.randint(0, 2**31 - 1),
            }  # fmt: skip
        elif kind == "eos":
            request.options = {"eos_token_id": rng.randint(1, VOCAB - 1)}
        elif kind == "closed":
            request.new = rng.randint(8, 40)
            request.close_after = rng.randint(1, request.new - 1)
        elif kind == "turn":
            request.follow_up = tokens(rng.randint(1, 12))
        requests.append(request)
    return requests


def run(job: pipesvc.Job, request: Request) -> None:
    time.sleep(request.delay_s)
    stream = job.stream(request.ids, request.new, attention_mask=request.mask, **request.options)
    for step, token in enumerate(stream):
        request.tokens.append(token.reshape(-1))
        if request.close_after is not None and step + 1 == request.close_after:
            stream.close()
            return


def next_turn(request: Request) -> Request:
    assert request.follow_up is not None
    answer = torch.stack(request.tokens, dim=1)[0]
    prompt = torch.cat([request.ids[0], answer, request.follow_up])
    ids, mask = left_padded([prompt])
    return Request("next turn", ids, mask, request.new, 0.0)


def check(reference: Any, request: Request) -> None:
    """Every token of ``request`` against ``reference`` run over the tokens before it."""
    new = torch.stack(request.tokens, dim=1)
    rows, made = new.shape
    expected_steps = request.close_after or request.new
    end = request.options.get("eos_token_id")
    if end is None or made == expected_steps:
        assert made == expected_steps, (request.kind, made, expected_steps)
    else:  # every row produced its end token, so the session ended early
        assert made < expected_steps and all(end in row.tolist() for row in new), request.kind
    sequence = torch.cat([request.ids, new], dim=1)
    mask = torch.cat([request.mask, torch.ones_like(new)], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = reference(sequence, attention_mask=mask, position_ids=positions).logits
    width = request.ids.shape[1]
    for row in range(rows):
        finished = False
        for step in range(made):
            token = int(new[row, step])
            if finished:
                assert token == end, (request.kind, row, step, token)
                continue
            scores = logits[row, width + step - 1].double()
            if "top_k" in request.options:
                # sampled: from the row's top_k most likely (the last of them within rounding)
                kth = scores.topk(request.options["top_k"]).values[-1]
                assert scores[token] >= kth - TOLERANCE, (request.kind, row, step, token)
            else:
                lead = float(scores.max() - scores[token])
                assert lead <= TOLERANCE * max(1.0, float(scores.abs().max())), (
                    f"{request.kind} session, row {row}, step {step}: token {token} is "
                    f"{lead:.3g} below the arg-max {int(scores.argmax())}"
                )
            finished = token == end


def run_all(
    job: pipesvc.Job, requests: list[Request], during: Callable[[], None] | None = None
) -> list[Request]:
    """Runs ``requests`` at once, each from a thread of its own (a turn's next turn after it),
    and ``during`` from this thread while they run; returns the next turns. Raises the first
    session's error, naming its kind."""
    turns: list[Request] = []
    errors: list[BaseException] = []

    def session(request: Request) -> None:
        try:
            run(job, request)
            if request.follow_up is not None:
                turn = next_turn(request)
                turns.append(turn)
                run(job, turn)
        except BaseException as exc:  # reported below, with the session's kind
            errors.append(RuntimeError(f"{request.kind} session: {exc!r}"))

    threads = [threading.Thread(target=session, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    if during is not None:
        during()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    assert len(turns) == sum(r.follow_up is not None for r in requests) > 0
    return turns
