"""Generation through faults: a stage SIGKILLed in the middle of a session (with a spare, and
with none, so the survivors are re-planned) and the client sees the tokens it would have seen
without the fault; a stage's KV budget refuses a session that would exceed it, with numbers."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from tests.support.faults import stage_pid
from tests.support.stage_probe import stage_info

VOCAB = 40


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(2)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _kill_after(stream: Iterator[torch.Tensor], steps: int, address: str) -> list[torch.Tensor]:
    tokens = [next(stream) for _ in range(steps)]
    os.kill(stage_pid(address), signal.SIGKILL)
    return tokens + list(stream)


@pytest.mark.parametrize(("num_stages", "spare"), [(2, True), (3, False)])
def test_a_stage_killed_mid_session_leaves_the_tokens_unchanged(
    llama_dir: Path, num_stages: int, spare: bool
) -> None:
    ids, mask = prompt()
    with (
        pipesvc.LocalCluster(
            num_stages=num_stages + spare, threads_per_stage=1, hf_models={"llama": llama_dir}
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="llama",
            loss="causal_lm",
            num_stages=num_stages,
            num_microbatches=2,
            checkpoint_every=0,
        ) as job,  # fmt: skip
    ):
        expected = job.generate(ids, 10, attention_mask=mask)[:, 6:]
        sampled = job.generate(ids, 10, attention_mask=mask, temperature=1.0, seed=3)[:, 6:]
        victim = job.plan[1].address
        got = _kill_after(job.stream(ids, 10, attention_mask=mask), 4, victim)
        assert torch.equal(torch.stack(got, dim=1), expected)
        assert job.refresh().recoveries == 1
        assert victim not in [s.address for s in job.plan]
        assert len(job.plan) == (num_stages if spare else num_stages - 1)
        # A sampled session goes on with the same generator state after a second loss.
        options = {"attention_mask": mask, "temperature": 1.0, "seed": 3}
        if len(job.plan) > 1:
            stream = job.stream(ids, 10, **options)  # type: ignore[arg-type]
            got = _kill_after(stream, 3, job.plan[-1].address)
            assert torch.equal(torch.stack(got, dim=1), sampled)


def test_a_session_over_the_kv_budget_is_refused_with_the_sizes(llama_dir: Path) -> None:
    ids, mask = prompt()
    with (
        pipesvc.LocalCluster(
            num_stages=2, threads_per_stage=1, hf_models={"llama": llama_dir},
            stage_args=["--kv-budget", "8KiB"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="llama", loss="causal_lm", num_stages=2, checkpoint_every=0
        ) as job,
    ):  # fmt: skip
        # 2 blocks per stage x (keys + values) x 2 heads x 8 dims x 4 bytes = 256 bytes a token
        # per row: 3 rows x 6 prompt tokens fit (4.5 KiB), 3 x 11 do not.
        assert job.generate(ids, 2, attention_mask=mask).shape == (3, 8)
        with pytest.raises(pipesvc.ResourceExhaustedError, match=r"over its budget of 0\.01 MiB"):
            job.generate(ids, 20, attention_mask=mask)
        assert [stage_info(s.address).sessions for s in job.plan] == [0, 0]
        assert job.generate(ids, 2, attention_mask=mask).shape == (3, 8)  # the stages serve on


def test_a_restarted_coordinator_frees_the_caches_its_predecessor_left(llama_dir: Path) -> None:
    """The coordinator is SIGKILLed while a session holds caches on the stages: the restarted
    coordinator frees them (not after the 300 s idle timeout), and a new session that fits the
    KV budget alone, but not beside the orphan, is served in full."""
    one_row = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    # 2 blocks per stage x (keys + values) x 2 heads x 8 dims x 4 bytes = 256 bytes a position:
    # one row of 6 + 55 positions fits 16 KiB (15.25), not beside an orphan of 7 or more.
    with pipesvc.LocalCluster(
        num_stages=2, threads_per_stage=1, hf_models={"llama": llama_dir},
        stage_args=["--kv-budget", "16KiB"],
    ) as cluster:  # fmt: skip
        client = cluster.connect()
        job = client.create_job(model="llama", loss="causal_lm", num_stages=2, checkpoint_every=0)
        expected = job.generate(one_row, 55)
        stream = job.stream(one_row, 55)
        next(stream)
        cluster.restart_coordinator(kill=True)
        addresses = [s.address for s in job.plan]
        client.close()
        held = [stage_info(a) for a in addresses]
        assert [i.sessions for i in held] == [1, 1] and all(i.cache_bytes for i in held)
        with cluster.connect() as client:
            job = client.get_job(job.id)
            assert torch.equal(job.generate(one_row, 55), expected)
            assert [stage_info(a).sessions for a in addresses] == [0, 0]
            job.close()
