"""Tied parameters and side inputs through faults and bad requests (see [Note: tied
parameters] and [Note: side inputs]).

GPT-2's head shares its matrix with the token embedding; over two stages each holds a copy and
the two swap their gradients at the end of every training run. A stage killed in any phase
around that swap (its backward, while the other waits in the swap; the commit; the checkpoint)
is replaced by the spare and the job ends bit-for-bit tied and equal to the tied model trained
in one process; the batches are left-padded, so the steps replayed from the step log must
carry their attention masks too. A malformed swap is refused with a typed error and changes
nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.core.tensor_codec import named_frames
from pipesvc.v1 import stage_pb2, stage_pb2_grpc

VOCAB = 40
STEPS = 5  # checkpoints at steps 2 and 4
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
EMBED, HEAD = "transformer.wte.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("gpt2")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded rows with their attention mask: a replayed step must see the mask again."""
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, VOCAB, (6, 8), generator=g)
    mask = torch.ones(6, 8, dtype=torch.long)
    for row in range(6):
        mask[row, : (row + step) % 5] = 0
    return ids, ids.masked_fill(mask == 0, -100), mask


def reference_weights(directory: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    model: Any = AutoModelForCausalLM.from_pretrained(directory)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, labels, mask = batch(step)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def create(client: pipesvc.Client, schedule: str) -> pipesvc.Job:
    return client.create_job(
        model="gpt2-tied", loss="causal_lm", optimizer=OPTIMIZER, schedule=schedule,
        num_stages=2, num_microbatches=3, checkpoint_every=2,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "schedule"),
    [
        # the first stage dies in its backward while the last waits in the swap with it
        ("backward:3:0", "gpipe"),
        # the last stage (the caller) dies in its backward; the first waits for its call
        ("backward:3:1", "1f1b"),
        ("commit:3:0", "gpipe"),
        ("checkpoint:4:1", "1f1b"),
    ],
)
def test_a_stage_lost_around_the_swap_recovers_tied_and_equal_to_one_process(
    gpt2_dir: Path, tmp_path: Path, fault: str, schedule: str
) -> None:
    marker = tmp_path / "fired"
    with (
        pipesvc.LocalCluster(
            num_stages=3,
            threads_per_stage=1,
            hf_models={"gpt2-tied": gpt2_dir},
            stage_args=["--fault-kill", f"{fault}:{marker}"],
        ) as cluster,
        cluster.connect() as client,
        create(client, schedule) as job,
    ):
        losses = [job.train_step(*batch(step)) for step in range(STEPS)]
        # The step-4 checkpoint streams from the stages' snapshots after step 5's run began:
        # a fault in it fires in the background, and the next call recovers.
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the fault never fired"
        weights = job.state_dict()
        assert job.refresh().recoveries == 1
    assert torch.equal(weights[EMBED], weights[HEAD])
    expected_losses, expected = reference_weights(gpt2_dir)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    for key, value in weights.items():
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key


def _swap(address: str, frames: list[stage_pb2.TiedGradientFrame]) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.SwapTiedGradients(iter(frames), timeout=10))
    return info.value


def test_a_malformed_swap_is_refused_and_changes_nothing(gpt2_dir: Path) -> None:
    with (
        pipesvc.LocalCluster(
            num_stages=2, threads_per_stage=1, hf_models={"gpt2-tied": gpt2_dir}
        ) as cluster,
        cluster.connect() as client,
        create(client, "1f1b") as job,
    ):
        losses = [job.train_step(*batch(0))]
        first = job.refresh().plan[0].address
        good = torch.zeros(VOCAB, 32)

        def frames(
            tensor: torch.Tensor, *, rank: int = 1, name: str = "0", job_id: str = job.id
        ) -> Iterator[stage_pb2.TiedGradientFrame]:
            for frame in named_frames(name, tensor):
                yield stage_pb2.TiedGradientFrame(
                    job_id=job_id, plan_epoch=job.plan_epoch, run_id=10**6, rank=rank,
                    frame=frame,
                )  # fmt: skip

        cases = {
            "wrong shape": (list(frames(torch.zeros(VOCAB, 31))), grpc.StatusCode.INVALID_ARGUMENT),
            "wrong dtype": (list(frames(good.double())), grpc.StatusCode.INVALID_ARGUMENT),
            "unknown group": (list(frames(good, name="3")), grpc.StatusCode.INVALID_ARGUMENT),
            "not a peer": (list(frames(good, rank=0)), grpc.StatusCode.INVALID_ARGUMENT),
            "other job": (list(frames(good, job_id="nope")), grpc.StatusCode.NOT_FOUND),
            "no frames": ([], grpc.StatusCode.INVALID_ARGUMENT),
        }
        for what, (sent, code) in cases.items():
            error = _swap(first, sent)
            assert error.code() == code, (what, error.details())
        # The stage is up and nothing it holds changed: training goes on as in one process.
        losses += [job.train_step(*batch(step)) for step in range(1, STEPS)]
        weights = job.state_dict()
    assert torch.equal(weights[EMBED], weights[HEAD])
    expected_losses, expected = reference_weights(gpt2_dir)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    for key, value in weights.items():
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key
