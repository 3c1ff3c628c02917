"""A stage killed in the middle of a chunked prefill that started from a kept prefix: the spare
takes its place, the prefix index of the old plan is forgotten, the session is replayed from its
first token, and every prompt still generates what ``transformers`` generates. A later prompt
with the same start reuses the prefix the replay kept on the new plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.coordinator.prefixes import BLOCK
from tests.integration.test_prompt_reuse import counters
from tests.support.faults import free_port, stage_pid

pytestmark = pytest.mark.timeout(300)

VOCAB = 48
NEW_TOKENS = 5
CHUNK = 32
SYSTEM = 6 * BLOCK + 3  # the start every prompt shares: 96 tokens in whole blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(5)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("prefill-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def prompts() -> list[torch.Tensor]:
    """The shared start, then tails of 40, 45 and 20 tokens."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(1, VOCAB, (1, SYSTEM), generator=g)
    return [
        torch.cat([system, torch.randint(1, VOCAB, (1, n), generator=g)], dim=1)
        for n in (40, 45, 20)
    ]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stage_killed_mid_prefill_from_a_kept_prefix_changes_no_token(
    model_dir: Path, tmp_path: Path, rank: int
) -> None:
    first, second, third = prompts()
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    with torch.no_grad():
        want = [
            reference.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False)
            for p in (first, second, third)
        ]
    port = free_port()
    # The first prompt's prefill is each stage's chunked run 1 (5 chunks); the second starts
    # from the 96 kept positions of the shared start, and its 44-token rest is chunked run 2
    # (2 chunks): the stage dies at its second chunk, with the first in its cache.
    fault = f"prefill:2:{rank}:{tmp_path / 'fired'}"
    with (
        pipesvc.LocalCluster(
            num_stages=3,
            threads_per_stage=1,
            hf_models={"llama": model_dir},
            coordinator_args=["--metrics-port", str(port)],
            stage_args=["--fault-kill", fault],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="llama", optimizer=None, num_stages=2, prefill_chunk=CHUNK, checkpoint_every=0
        ) as job,
    ):
        survivor = job.plan[1 - rank].address
        survivor_pid = stage_pid(survivor)
        victim = job.plan[rank].address
        got = [job.generate(first, NEW_TOKENS)]
        assert counters(port).get("prefix_hits_total", 0) == 0
        got.append(job.generate(second, NEW_TOKENS))
        assert (tmp_path / "fired").exists()
        job.refresh()
        assert job.recoveries == 1
        assert victim not in [s.address for s in job.plan]
        assert stage_pid(survivor) == survivor_pid  # the neighbour lived through it
        # Its replay chose again on the new plan, which keeps no prefix of the old one, so no
        # run started from a prefix that was gone.
        assert counters(port).get("generation_replays_total", 0) == 0
        hits_after_fault = counters(port).get("prefix_hits_total", 0)
        got.append(job.generate(third, NEW_TOKENS))
        # The replayed second prompt kept its start on the new plan; the third reuses it.
        assert counters(port).get("prefix_hits_total", 0) == hits_after_fault + 1
    for tokens, expected in zip(got, want, strict=True):
        assert torch.equal(tokens, expected)
