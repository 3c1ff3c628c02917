"""Sessions of every kind at once (see ``tests/support/serving_mix.py``) while a stage is
SIGKILLed: with a spare stage to take its layers, and with none (the survivors re-planned).
Sessions fused in runs, kept prefixes, prompts in chunks and runs of several decode steps are
all in flight when it dies; every session still makes the model's tokens (checked one by one
against the model in one process), and every stage that is left ends holding no session."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

import pipesvc
from tests.support.faults import stage_pid
from tests.support.serving_mix import CHUNK, check, draw_requests, run_all, save_model
from tests.support.stage_probe import stage_info


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("mix-llama")
    save_model(directory)
    return directory


def kill_after(delay_s: float, address: str) -> Callable[[], None]:
    def kill() -> None:
        time.sleep(delay_s)
        os.kill(stage_pid(address), signal.SIGKILL)

    return kill


@pytest.mark.parametrize(
    ("seed", "spare", "victim", "delay_s"),
    [(4, True, 1, 0.3), (5, False, 2, 0.5), (6, True, 0, 0.15)],
)
def test_sessions_of_every_kind_survive_a_stage_killed_among_them(
    model_dir: Path, seed: int, spare: bool, victim: int, delay_s: float
) -> None:
    requests = draw_requests(seed)
    with (
        pipesvc.LocalCluster(
            num_stages=3 + spare, threads_per_stage=1, hf_models={"mix-llama": model_dir}
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model="mix-llama", optimizer=None, num_stages=3, num_microbatches=2,
            decode_steps=4, prefill_chunk=CHUNK,
        ) as job,
    ):  # fmt: skip
        address = job.plan[victim].address
        turns = run_all(job, requests, during=kill_after(delay_s, address))
        assert job.refresh().recoveries >= 1
        assert address not in [s.address for s in job.plan]
        assert len(job.plan) == (3 if spare else 2)
        deadline = time.monotonic() + 10
        while any(stage_info(s.address).sessions for s in job.plan):
            assert time.monotonic() < deadline, [stage_info(s.address) for s in job.plan]
            time.sleep(0.1)
    reference: Any = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for request in requests + turns:
        check(reference, request)
