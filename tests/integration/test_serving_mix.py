"""Many sessions of every kind at once, each checked token by token against the model in one
process.

Each scenario draws, from its seed, sessions that a busy server sees side by side: prompts that
share a system prompt (kept prefixes), a chat's next turn (its previous prompt and answer, then
more), prompts long enough to run in chunks, several left-padded rows in one session, sampled
sessions with a seed, sessions with an end token, and streams a client closes halfway. They
start at staggered times from threads of their own, so they join and leave each other's runs
(fused decode steps, runs of several steps, chunks beside decode steps) wherever the timing
puts them.

The oracle is the model itself, not a recorded output: each session's tokens are run through
``transformers`` in one process (prompt and all the tokens before it, left padding masked as
``generate`` masks it), and every greedy token must be the row's arg-max there, within float
rounding (a fused batch sums in another order, so a near tie may go either way; an exact
comparison would make the test depend on which sessions happened to share a run). A sampled
token must be among the row's ``top_k`` most likely, and a row that produced its end token
produces only that token after it. Once every session ended, no stage holds one.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.coordinator.prefixes import BLOCK
from tests.support.stage_probe import stage_info

VOCAB = 64
TOLERANCE = 1e-4
"""How far below the row's largest logit (in the one-process model) a chosen token's logit
may be: float rounding of a fused batch, never a different token's lead."""
SYSTEM = 2 * BLOCK + 3
CHUNK = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("mix-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    return model.eval()


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[pipesvc.LocalCluster]:
    with pipesvc.LocalCluster(
        num_stages=3, threads_per_stage=1, hf_models={"mix-llama": model_dir}
    ) as cluster:
        yield cluster


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


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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
            ids, mask = _left_padded([torch.cat([system, tokens(rng.randint(1, 20))])])
        elif kind == "long":
            ids, mask = _left_padded([tokens(rng.randint(3 * CHUNK, 6 * CHUNK))])
        else:  # rows: uneven prompts in one session, some sharing the system prompt
            rows = [
                torch.cat([system, tokens(rng.randint(1, 9))]) if rng.random() < 0.5
                else tokens(rng.randint(1, 40))
                for _ in range(rng.randint(2, 3))
            ]  # fmt: skip
            ids, mask = _left_padded(rows)
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
    ids, mask = _left_padded([prompt])
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


@pytest.mark.parametrize(
    ("seed", "decode_steps", "prefill_chunk"), [(1, 4, CHUNK), (2, 1, CHUNK), (3, 3, None)]
)
def test_sessions_of_every_kind_at_once_each_make_the_models_tokens(
    cluster: pipesvc.LocalCluster,
    reference: Any,
    seed: int,
    decode_steps: int,
    prefill_chunk: int | None,
) -> None:
    requests = draw_requests(seed)
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

    with (
        cluster.connect() as client,
        client.create_job(
            model="mix-llama", optimizer=None, num_stages=3, num_microbatches=2,
            decode_steps=decode_steps, prefill_chunk=prefill_chunk,
        ) as job,
    ):  # fmt: skip
        threads = [threading.Thread(target=session, args=(r,)) for r in requests]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads)
        deadline = time.monotonic() + 10
        while any(stage_info(s.address).sessions for s in job.plan):
            assert time.monotonic() < deadline, [stage_info(s.address) for s in job.plan]
            time.sleep(0.1)
    assert len(turns) == sum(r.follow_up is not None for r in requests) > 0
    for request in requests + turns:
        check(reference, request)


def test_more_sessions_than_sixteen_stream_at_once_from_python_clients(
    cluster: pipesvc.LocalCluster, reference: Any
) -> None:
    """Each Python client's session holds a stream to the coordinator while it generates; the
    coordinator's stream cap (once 16, refusing the 17th with RESOURCE_EXHAUSTED while the
    stages' caches had room) leaves the KV budget to decide how many fit."""
    g = torch.Generator().manual_seed(9)
    requests = [
        Request("held", *_left_padded([torch.randint(1, VOCAB, (5 + i % 7,), generator=g)]), 120, 0)
        for i in range(24)
    ]
    with (
        cluster.connect() as client,
        client.create_job(model="mix-llama", optimizer=None, num_stages=3) as job,
    ):
        streams = [job.stream(r.ids, r.new, attention_mask=r.mask) for r in requests]
        for request, stream in zip(requests, streams, strict=True):
            # each stream open at once: the server cannot end one before its 120 tokens
            request.tokens.append(next(stream).reshape(-1))
        for request, stream in zip(requests, streams, strict=True):
            request.tokens += [token.reshape(-1) for token in stream]
    for request in requests:
        check(reference, request)
