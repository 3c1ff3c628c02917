"""Generation sessions over time, on real stage processes: idle sessions expire on the stages'
own timer (no run, no read needed); a session that a stage lost replays alone while the
sessions fused with it keep their caches; a restarted coordinator frees the caches its
predecessor's sessions left, and a new session is not refused in their place.

The first two drive a coordinator in this process (a real ``CoordinatorService`` on a real
gRPC server, real stage processes): the test is the reader of its sessions, so it can leave
one unread past the stages' idle timeout, which a gRPC client cannot (the coordinator reads a
stream's tokens into gRPC's buffers as they are made)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.coordinator.job import JobDriver
from pipesvc.coordinator.service import CoordinatorService
from pipesvc.coordinator.session import Session
from pipesvc.core.health import Health
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.sampling import Sampling
from pipesvc.local_cluster import stage_environ
from pipesvc.v1 import coordinator_pb2_grpc
from pipesvc.wire.transport import create_server
from tests.support.faults import free_port
from tests.support.stage_probe import stage_info

VOCAB = 40
IDLE_S = 1.0


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


class InProcess:
    """A coordinator served from this process, and stage processes registered with it."""

    def __init__(self, tmp: Path, llama: Path, num_stages: int) -> None:
        self.service = CoordinatorService(tmp / "state")
        self.service.open()
        self.server, port, _ = create_server(
            "127.0.0.1:0",
            [
                lambda s: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
                    self.service, s
                )
            ],
        )
        self.address = f"127.0.0.1:{port}"
        self.metrics_ports = [free_port() for _ in range(num_stages)]
        self.procs = []
        for rank, metrics_port in enumerate(self.metrics_ports):
            log = open(tmp / f"stage-{rank}.log", "ab")  # noqa: SIM115 - owned by the child
            args = ["stage", "--coordinator", self.address, "--listen", "127.0.0.1:0"]
            args += ["--threads", "1", "--hf-model", f"llama={llama}"]
            args += ["--session-idle-s", str(IDLE_S), "--metrics-port", str(metrics_port)]
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pipesvc", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=stage_environ(),
                )
            )
            log.close()
        try:
            self.client = pipesvc.connect(self.address)
            self._wait_for_stages(num_stages)
        except BaseException:
            self.close()
            raise

    def _wait_for_stages(self, num_stages: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stages = self.client.stages()
            if sum(s.health == Health.SERVING for s in stages) == num_stages:
                break
            time.sleep(0.2)
        else:
            raise TimeoutError("the stages did not register")

    def job(self, job_id: str) -> JobDriver:
        return self.service._job(job_id)  # the seam: this process is the coordinator

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=30)
        self.server.stop(grace=None).wait()
        self.service.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Iterator[InProcess]:
    cluster = InProcess(tmp_path_factory.mktemp("cluster"), llama_dir, num_stages=2)
    try:
        yield cluster
    finally:
        cluster.close()


def _gauge(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(rf"^pipesvc_{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert found is not None, text
    return float(found.group(1))


def _prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _sessions(job: JobDriver, prompts: list[torch.Tensor]) -> list[Session]:
    support = job.generation._model_support()
    return [Session(p, None, parts=2, sampling=Sampling(), support=support) for p in prompts]


def _recording(job: JobDriver) -> list[RunBatch]:
    """Records every batch the job's generation sends to its stages (wraps its run phase)."""
    sent: list[RunBatch] = []
    run: Callable[..., Any] = job.generation._run

    def recorded(mode: Any, batch: RunBatch, during: Callable[[], None]) -> Any:
        sent.append(batch)
        return run(mode, batch, during)

    job.generation._run = recorded
    return sent


def _step(job: JobDriver, sessions: list[Session]) -> None:
    """One step of every session in one run, as the job's batcher runs them."""
    steps = job.generation._steps(sessions, lambda: None, 1)
    for session, ([logits], epoch) in zip(sessions, steps, strict=True):
        session.advance(logits, epoch)


def test_idle_sessions_expire_on_the_stages_own_timer(cluster: InProcess) -> None:
    """A session left idle past --session-idle-s: its caches go although no run starts and
    nothing reads the stages' Info (the stages' gauges drop on their own)."""
    with cluster.client.create_job(
        model="llama", loss="causal_lm", num_stages=2, num_microbatches=2, checkpoint_every=0
    ) as handle:
        job = cluster.job(handle.id)
        (session,) = _sessions(job, [_prompt(1, 5)])
        for _ in range(2):
            _step(job, [session])
        assert [_gauge(p, "open_generation_sessions") for p in cluster.metrics_ports] == [1, 1]
        deadline = time.monotonic() + 10 * IDLE_S
        while time.monotonic() < deadline:
            gauges = [_gauge(p, "open_generation_sessions") for p in cluster.metrics_ports]
            if gauges == [0, 0]:
                break
            time.sleep(0.1)
        assert gauges == [0, 0]
        assert [_gauge(p, "kv_cache_bytes") for p in cluster.metrics_ports] == [0, 0]
        assert [stage_info(s.address).sessions for s in handle.plan] == [0, 0]


def test_a_session_lost_by_the_stages_replays_alone(cluster: InProcess) -> None:
    """Two sessions fused into one run; one is left unread past the idle timeout (the other
    goes on) and its caches expire: when its reader comes back, only it replays its tokens, the
    other takes its step from its caches, and both get the tokens they get without a pause."""
    with cluster.client.create_job(
        model="llama", loss="causal_lm", num_stages=2, num_microbatches=2, checkpoint_every=0
    ) as handle:
        prompts = [_prompt(2, 6), _prompt(3, 4)]
        job = cluster.job(handle.id)
        slow, steady = sessions = _sessions(job, prompts)
        for _ in range(3):
            _step(job, sessions)
        # The slow reader stops; the steady one goes on until the slow one's caches expire.
        deadline = time.monotonic() + 10 * IDLE_S
        while time.monotonic() < deadline:
            _step(job, [steady])
            if [stage_info(s.address).sessions for s in handle.plan] == [1, 1]:
                break
            time.sleep(0.25)
        assert [stage_info(s.address).sessions for s in handle.plan] == [1, 1]
        sent = _recording(job)
        for _ in range(5):
            _step(job, sessions)
        # The run after the pause failed on the lost session alone, and went again with it
        # replaying (fresh) and the steady one extending its caches by one position.
        fresh = [{ref.session: ref.fresh for refs in b.caches for ref in refs} for b in sent]
        assert fresh[0] == {slow.id: False, steady.id: False}
        assert fresh[1] == {slow.id: True, steady.id: False}
        assert all(not any(f.values()) for f in fresh[2:])
        for session, prompt in zip(sessions, prompts, strict=True):
            made = session.tokens.shape[1] - prompt.shape[1]
            assert torch.equal(session.tokens, handle.generate(prompt, made))
