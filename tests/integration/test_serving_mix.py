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

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import pipesvc
from tests.support.faults import free_port
from tests.support.serving_mix import (
    CHUNK,
    VOCAB,
    Request,
    check,
    draw_requests,
    left_padded,
    run_all,
    save_model,
)
from tests.support.stage_probe import stage_info


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("mix-llama")
    save_model(directory)
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
    with (
        cluster.connect() as client,
        client.create_job(
            model="mix-llama", optimizer=None, num_stages=3, num_microbatches=2,
            decode_steps=decode_steps, prefill_chunk=prefill_chunk,
        ) as job,
    ):  # fmt: skip
        turns = run_all(job, requests)
        deadline = time.monotonic() + 10
        while any(stage_info(s.address).sessions for s in job.plan):
            assert time.monotonic() < deadline, [stage_info(s.address) for s in job.plan]
            time.sleep(0.1)
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
        Request("held", *left_padded([torch.randint(1, VOCAB, (5 + i % 7,), generator=g)]), 120, 0)
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


def test_sessions_over_a_full_kv_budget_wait_for_room_and_make_the_models_tokens(
    model_dir: Path, reference: Any
) -> None:
    """See [Note: waiting for room] in ``pipesvc.coordinator.batcher``: with caches for only
    about ten of the sessions at once, the ones that do not fit wait (their caches dropped) and
    replay when others close, instead of failing halfway through their tokens; none fails, and
    every token is still the model's."""
    port = free_port()
    requests = draw_requests(7)
    with (
        pipesvc.LocalCluster(
            num_stages=3, threads_per_stage=1, hf_models={"mix-llama": model_dir},
            stage_args=["--kv-budget", "200000"], coordinator_args=["--metrics-port", str(port)],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="mix-llama", optimizer=None, num_stages=3, num_microbatches=2,
            prefill_chunk=CHUNK,
        ) as job,
    ):  # fmt: skip
        turns = run_all(job, requests)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            metrics = reply.read().decode()
    evictions = [
        line
        for line in metrics.splitlines()
        if line.startswith("pipesvc_generation_evictions_total ")
    ]
    assert evictions and float(evictions[0].split()[-1]) > 0, evictions
    for request in requests + turns:
        check(reference, request)
