"""Long and shared prompts: prefixes kept on the stages (see [Note: prefix reuse] in
``pipesvc.stage.compute.sessions``) and prompts prefilled in chunks (see [Note: chunked prefill] in
``pipesvc.coordinator.session``). Prompts that share a start, or run in chunks, generate
exactly what ``transformers`` generates; a prefix a stage dropped to stay within its KV budget
costs a replay, never a wrong token."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.coordinator.prefixes import BLOCK
from tests.support.faults import free_port

VOCAB = 64
NEW_TOKENS = 6
SYSTEM = 3 * BLOCK + 2  # tokens every prompt starts with


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("prefix-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("pipesvc_prefix", "pipesvc_generation_replays")):
            found[name.removeprefix("pipesvc_")] = float(value)
    return found


def prompts() -> list[torch.Tensor]:
    """A shared start, then tails of 7, 9 and 30 tokens; the first asked twice."""
    g = torch.Generator().manual_seed(1)
    system = torch.randint(1, VOCAB, (1, SYSTEM), generator=g)
    tails = [torch.randint(1, VOCAB, (1, n), generator=g) for n in (7, 9, 30)]
    first, second, third = (torch.cat([system, tail], dim=1) for tail in tails)
    return [first, second, first, third]


def expected(model_dir: Path) -> list[torch.Tensor]:
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [
            reference.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts()
        ]


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[tuple[pipesvc.LocalCluster, int]]:
    port = free_port()
    with pipesvc.LocalCluster(
        num_stages=2,
        threads_per_stage=1,
        hf_models={"prefix-llama": model_dir},
        coordinator_args=["--metrics-port", str(port)],
    ) as cluster:
        yield cluster, port


def test_prompts_sharing_a_start_compute_only_their_rest_and_generate_the_same(
    cluster: tuple[pipesvc.LocalCluster, int], model_dir: Path
) -> None:
    local, port = cluster
    with local.connect() as client, client.create_job(model="prefix-llama", optimizer=None) as job:
        before = counters(port)
        outputs = [job.generate(p, NEW_TOKENS) for p in prompts()]
        after = counters(port)
    for got, want in zip(outputs, expected(model_dir), strict=True):
        assert torch.equal(got, want)
    # The first prompt keeps its whole blocks; the second and third start from the blocks of
    # the shared start, the repeat from all the blocks the first kept.
    shared = (SYSTEM // BLOCK) * BLOCK
    first_kept = ((prompts()[0].shape[1] - 1) // BLOCK) * BLOCK
    hits = after.get("prefix_hits_total", 0) - before.get("prefix_hits_total", 0)
    reused = after.get("prefix_tokens_reused_total", 0) - before.get(
        "prefix_tokens_reused_total", 0
    )
    assert hits == 3
    assert reused == shared + first_kept + shared


def test_a_prefix_dropped_for_the_kv_budget_costs_a_replay_not_a_token(
    model_dir: Path,
) -> None:
    """Stages whose budget holds a session but not the session and its prefix drop each prefix
    as soon as it is kept; the coordinator still believes it kept, so the next prompt starts
    from it, fails on the stages, and is replayed from its first token."""
    port = free_port()
    per_position = 2 * 2 * 8 * 4  # keys and values of 2 heads of 8 floats, per layer
    longest = max(p.shape[1] for p in prompts()) + NEW_TOKENS
    budget = 2 * longest * per_position + per_position  # one session of at most 2 layers
    with (
        pipesvc.LocalCluster(
            num_stages=2,
            threads_per_stage=1,
            hf_models={"prefix-llama": model_dir},
            coordinator_args=["--metrics-port", str(port)],
            stage_args=["--kv-budget", str(budget)],
        ) as local,
        local.connect() as client,
        client.create_job(model="prefix-llama", optimizer=None) as job,
    ):
        outputs = [job.generate(p, NEW_TOKENS) for p in prompts()[:2]]
        found = counters(port)
    for got, want in zip(outputs, expected(model_dir)[:2], strict=True):
        assert torch.equal(got, want)
    assert found.get("generation_replays_total") == 1
    assert found.get("prefix_hits_total", 0) == 0  # the start from the dropped prefix failed


def test_stages_holding_only_the_embedding_or_the_head_serve_prefixes_too(
    tmp_path: Path,
) -> None:
    """4 stages of a 2-block Llama, a layer each: the first holds only the embedding and the
    last only the head, so their caches stay empty. Prompts sharing a start still start from
    the kept prefix on every stage (none is replayed), and sessions at once (their decode
    steps fused, in runs of several steps) generate ``transformers``' tokens too."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    port = free_port()
    with (
        pipesvc.LocalCluster(
            num_stages=4,
            threads_per_stage=1,
            hf_models={"two-blocks": tmp_path},
            coordinator_args=["--metrics-port", str(port)],
        ) as local,
        local.connect() as client,
        client.create_job(
            model="two-blocks", optimizer=None, num_stages=4, partition="uniform"
        ) as job,
    ):
        assert [(s.start_layer, s.end_layer) for s in job.plan] == [(0, 1), (1, 2), (2, 3), (3, 4)]
        outputs = [job.generate(p, NEW_TOKENS) for p in prompts()]
        found = counters(port)
        g = torch.Generator().manual_seed(3)
        others = [torch.randint(1, VOCAB, (1, 5 + 4 * i), generator=g) for i in range(4)]
        together: list[torch.Tensor | None] = [None] * len(others)

        def run(i: int) -> None:
            together[i] = job.generate(others[i], 12)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(others))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    with torch.no_grad():
        for got, prompt in zip(outputs, prompts(), strict=True):
            want = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(got, want)
        for got, prompt in zip(together, others, strict=True):
            assert got is not None
            assert torch.equal(got, reference.generate(prompt, max_new_tokens=12, do_sample=False))
    assert found.get("prefix_hits_total", 0) == 3
    assert found.get("generation_replays_total", 0) == 0


def test_long_prompts_run_in_chunks_through_the_stages_and_generate_the_same(
    cluster: tuple[pipesvc.LocalCluster, int], model_dir: Path
) -> None:
    """Two left-padded rows of 300 tokens in chunks of 64 (each part in 5 chunks that extend
    its cache in order), then a prompt that starts from a kept prefix and runs its rest in
    chunks."""
    local, _ = cluster
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (2, 300), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :37] = 0
    ids[0, :37] = 0
    longer = torch.cat([ids[1:], torch.randint(1, VOCAB, (1, 150), generator=g)], dim=1)
    with (
        local.connect() as client,
        client.create_job(
            model="prefix-llama", optimizer=None, num_microbatches=2, prefill_chunk=64
        ) as job,
    ):
        padded = job.generate(ids, NEW_TOKENS, attention_mask=mask)
        alone = job.generate(ids[1:], NEW_TOKENS)  # keeps its blocks for ``longer``
        extended = job.generate(longer, NEW_TOKENS)
        timelines = job.timelines(max_runs=3 * NEW_TOKENS)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    with torch.no_grad():
        for got, prompt, prompt_mask in (
            (padded, ids, mask), (alone, ids[1:], None), (extended, longer, None)
        ):  # fmt: skip
            want = reference.generate(
                prompt, attention_mask=prompt_mask, max_new_tokens=NEW_TOKENS, do_sample=False
            )
            assert torch.equal(got, want)
    # The prompts' runs: two parts of 5 chunks; 5 chunks; the 150 tokens after the kept
    # blocks (288 of 300) in 3 chunks.
    forwards = [e for e in timelines[0].events if e.name == "forward"]
    per_run = {}
    for event in forwards:
        per_run.setdefault(event.run_id, set()).add(event.microbatch)
    counts = [len(per_run[r]) for r in sorted(per_run)]
    assert [c for c in counts if c > 1] == [10, 5, 3]


def test_a_long_prompt_beside_a_decoding_session_runs_one_chunk_per_step(
    cluster: tuple[pipesvc.LocalCluster, int], model_dir: Path
) -> None:
    """See [Note: chunks between decode steps]: while a session decodes, a long prompt that
    arrives sends one chunk per run beside its decode step, so that session never waits for
    more than one chunk; both generate ``transformers``' tokens."""
    local, _ = cluster
    g = torch.Generator().manual_seed(6)
    short = torch.randint(1, VOCAB, (1, 10), generator=g)
    long = torch.randint(1, VOCAB, (1, 200), generator=g)  # 7 chunks of at most 32
    long_tokens: list[torch.Tensor] = []
    with (
        local.connect() as client,
        client.create_job(model="prefix-llama", optimizer=None, prefill_chunk=32) as job,
    ):
        stream = job.stream(short, 40)
        tokens = [next(stream), next(stream)]
        other = threading.Thread(target=lambda: long_tokens.append(job.generate(long, 4)))
        other.start()
        tokens += list(stream)
        other.join(timeout=120)
        timelines = job.timelines()
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    with torch.no_grad():
        want_short = reference.generate(short, max_new_tokens=40, do_sample=False)
        want_long = reference.generate(long, max_new_tokens=4, do_sample=False)
    assert torch.equal(torch.cat([short, torch.stack(tokens, dim=1)], dim=1), want_short)
    assert torch.equal(long_tokens[0], want_long)
    per_run: dict[int, set[int]] = {}
    for event in timelines[0].events:
        if event.name == "forward":
            per_run.setdefault(event.run_id, set()).add(event.microbatch)
    counts = [len(per_run[r]) for r in sorted(per_run)]
    # The decode step, and beside it each of the long prompt's chunks in a run of its own
    # (all 7 in one run would have made a run of 8 micro-batches).
    assert max(counts) == 2 and counts.count(2) == 7, counts
