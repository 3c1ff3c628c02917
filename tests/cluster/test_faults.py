"""Faults cost no committed work: killed, hung, cut-off and stopped stages and coordinators.

Every test trains against the one-process oracle and ends with weights equal to it (rtol 1e-5,
atol 1e-6), so a recovery that lost, repeated or reordered a step would fail.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import pipesvc
from tests.support.faults import (
    FAULT_TOL,
    MLP,
    Cut,
    Http2Scanner,
    Run,
    TcpProxy,
    free_port,
    stage_pid,
)


@pytest.fixture
def marker(tmp_path: Path) -> str:
    return str(tmp_path / "fault-fired")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _cluster(
    num_stages: int, fault: str | None = None, *, shm: bool = True
) -> pipesvc.LocalCluster:
    args = ["--fault-kill", fault] if fault else []
    args += [] if shm else ["--shm-bytes", "0"]
    return pipesvc.LocalCluster(num_stages=num_stages, threads_per_stage=1, stage_args=args)


@pytest.mark.parametrize(
    ("when", "step", "rank", "checkpoint_every"),
    [
        ("forward", 3, 1, 2),  # restore the step-2 checkpoint, nothing to replay
        ("backward", 4, 0, 0),  # no checkpoint: rebuild from the seed, replay steps 1-3
        ("commit", 3, 1, 2),  # rank 0 may have committed already: all or none still holds
    ],
)
def test_killed_stage_is_replaced_by_a_spare(
    marker: str, when: str, step: int, rank: int, checkpoint_every: int
) -> None:
    with _cluster(3, f"{when}:{step}:{rank}:{marker}") as cluster, cluster.connect() as client:
        run = Run.start(client, checkpoint_every=checkpoint_every)
        before = run.job.plan[rank].address
        for _ in range(6):
            run.step()
        assert os.path.exists(marker), "the fault never fired"
        job = run.job.refresh()
        assert job.recoveries == 1
        assert job.plan[rank].address != before
        run.check_weights()
        print(
            f"\n{when}: faulty step {run.step_seconds[step - 1]:.2f} s, "
            f"others {sorted(run.step_seconds)[len(run.step_seconds) // 2]:.3f} s"
        )


def test_without_a_spare_the_survivor_takes_every_layer(marker: str) -> None:
    with _cluster(2, f"forward:2:1:{marker}") as cluster, cluster.connect() as client:
        run = Run.start(client)
        for _ in range(4):
            run.step()
        job = run.job.refresh()
        assert job.recoveries == 1
        assert len(job.plan) == 1
        assert (job.plan[0].start_layer, job.plan[0].end_layer) == (0, job.num_layers)
        run.check_weights()


def test_hung_stage_is_detected_and_replaced() -> None:
    with _cluster(3) as cluster, cluster.connect() as client:
        run = Run.start(client)
        run.step()
        run.step()
        pid = stage_pid(run.job.plan[1].address)
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            run.step()
            took = time.monotonic() - started
            for _ in range(2):
                run.step()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert run.job.refresh().recoveries == 1
        run.check_weights()
        print(f"\nhung stage: detected and recovered within {took:.2f} s")


def test_forward_survives_a_killed_stage() -> None:
    with _cluster(3) as cluster, cluster.connect() as client:
        run = Run.start(client)
        run.step()
        os.kill(stage_pid(run.job.plan[0].address), signal.SIGKILL)
        x, _ = MLP.batch(5, seed=77)
        out = run.job.forward(x)
        with torch.no_grad():
            torch.testing.assert_close(out, run.reference.model(x), **FAULT_TOL)
        assert run.job.refresh().recoveries == 1


# Activations of 2-3 rows x 1024 floats: 8-12 KiB DATA frames, where nothing else a client
# sends a stage mid-step (run requests, targets of 3 columns) comes near 4 KiB.
WIDE_MLP = dataclasses.replace(MLP, model_args={**MLP.model_args, "hidden_features": 1024})
LARGE_FRAME_BYTES = 4096


@pytest.mark.parametrize("fault", ["hang", "reset"])
def test_cut_link_to_a_stage(fault: str) -> None:
    """Rank 1 is reached only through the proxy. Shared memory is off, so activations and
    gradients are frames on the proxied stream (on one host they would bypass the proxy)."""
    with _cluster(1, shm=False) as cluster, cluster.connect() as client:
        real = free_port()
        proxy = TcpProxy(real)
        try:
            cluster.add_stage(
                ["--listen", f"127.0.0.1:{real}", "--advertise", f"127.0.0.1:{proxy.port}"]
            )
            cluster.add_stage()  # the spare
            run = Run.start(client, problem=WIDE_MLP)
            assert run.job.plan[1].address == f"127.0.0.1:{proxy.port}"
            run.step()
            run.step()
            if fault == "hang":
                proxy.hang()
            else:
                # Mid-step and mid-message: 1000 bytes into the next large frame rank 0
                # sends rank 1, an activation.
                proxy.cut_data_frame(min_payload_bytes=LARGE_FRAME_BYTES, into_bytes=1000)
            for _ in range(3):
                run.step()
            assert run.job.refresh().recoveries == 1
            if fault == "reset":
                assert proxy.resets == 1
                [cut] = proxy.cuts
                assert cut.payload_bytes >= LARGE_FRAME_BYTES and cut.forwarded_bytes == 1000
            else:
                assert run.job.plan[1].address != f"127.0.0.1:{proxy.port}"
            run.check_weights()
        finally:
            proxy.close()


def test_proxy_cuts_inside_the_large_data_frame() -> None:
    """The proxy's frame scanner, on bytes laid out by hand: preface, SETTINGS, a small and a
    large DATA frame, fed in awkward chunks."""

    def frame(kind: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + (1).to_bytes(4, "big") + payload

    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    small, large = frame(0, b"s" * 50), frame(0, b"L" * 5000)
    stream = preface + frame(4, b"x" * 6) + small + large
    scanner = Http2Scanner()
    cut_at = None
    for start in range(0, len(stream), 7):
        found = scanner.cut_offset(stream[start : start + 7], 1000, 300)
        if found is not None:
            cut_at = (start + found[0], found[1])
            break
    assert cut_at == (len(stream) - 5000 + 300, Cut(payload_bytes=5000, forwarded_bytes=300))


def test_killed_coordinator_resumes_from_its_state_dir() -> None:
    with _cluster(2) as cluster:
        client = cluster.connect()
        run = Run.start(client)
        for _ in range(3):
            run.step()
        job_id = run.job.id
        client.close()
        cluster.restart_coordinator(kill=True)
        with cluster.connect() as client:
            job = client.get_job(job_id)
            assert job.step == 3
            run.job = job
            for _ in range(3):
                run.step()
            run.check_weights()
            assert job.refresh().recoveries == 0  # the stages kept their state


def test_sigterm_on_a_stage_moves_its_layers_without_a_failure() -> None:
    with _cluster(3) as cluster, cluster.connect() as client:
        run = Run.start(client)
        run.step()
        leaving = run.job.plan[1].address
        pid = stage_pid(leaving)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
            if _is_zombie(pid):  # exited, not yet reaped by LocalCluster
                break
        else:
            pytest.fail("the stopped stage did not exit after handing over")
        for _ in range(2):
            run.step()
        job = run.job.refresh()
        assert leaving not in {s.address for s in job.plan}
        assert job.recoveries == 0
        run.check_weights()


def test_sigterm_on_the_coordinator_keeps_the_job() -> None:
    with _cluster(2) as cluster:
        client = cluster.connect()
        run = Run.start(client)
        run.step()
        client.close()
        cluster.restart_coordinator(kill=False)
        with cluster.connect() as client:
            run.job = client.get_job(run.job.id)
            run.step()
            run.check_weights()
