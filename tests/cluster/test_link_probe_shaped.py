"""The link probe on a real slow link (see [Note: link probe] in pipesvc/stage/net/probe.py): two
stage hosts joined by a veth shaped to 100 Mbit/s with ``tc tbf`` (``bench/links.py``'s
``Topology``: network namespaces, a private ``/dev/shm`` per stage host, the coordinator and
this test's client on a third). The probe reads the link's rate within 30% of 12.5 MB/s, and
``wire_dtype="auto"`` compresses the activation-heavy MLP's link (int8 activations, bfloat16
gradients); with the shaping removed, the same job's next re-plan probes a fast link and puts
it back to exact. Bytes and decisions are checked, not timings of the job. Needs root, ``ip``
and ``tc``; every namespace and process is removed at the end, also on a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.links import Processes, Rate, Topology, why_not_runnable

REPO = Path(__file__).resolve().parents[2]
LINK_BYTES_PER_S = 100e6 / 8
"""tbf's 100 Mbit/s in bytes per second (packet bytes; the payload is a few percent less)."""
COORDINATOR_PORT, STAGE_PORT = 7071, 50051


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[Topology, Processes]]:
    reason = why_not_runnable()
    if reason:
        pytest.skip(f"a shaped link {reason}")
    topo = Topology(f"p{os.getpid() % 100000}")
    procs = Processes()
    made = subprocess.run(
        ["ip", "netns", "add", topo.netns["c"]], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", topo.netns["c"]], capture_output=True, check=False)
    try:
        for command in topo.setup_commands():
            subprocess.run(command, check=True, capture_output=True, timeout=30)
        yield topo, procs
    finally:
        procs.stop()
        for command in topo.teardown_commands():
            subprocess.run(command, capture_output=True, check=False, timeout=30)


def _shape(topo: Topology, rate: str) -> None:
    for command in topo.shape_commands(Rate.parse(rate)):
        subprocess.run(command, check=rate != "none", capture_output=True, timeout=30)


def _answer(client: subprocess.Popen[str]) -> dict[str, Any]:
    assert client.stdout is not None
    seen = []
    for line in client.stdout:
        if line.startswith("{"):
            answer: dict[str, Any] = json.loads(line)
            return answer
        seen.append(line)
    raise AssertionError(f"the client exited with {client.wait()}: {''.join(seen)[-3000:]}")


def test_the_probe_reads_a_shaped_link_and_auto_compresses_only_it(
    hosts: tuple[Topology, Processes], tmp_path: Path
) -> None:
    topo, procs = hosts
    ns = topo.netns
    _shape(topo, "100mbit")
    python = [sys.executable, "-m", "pipesvc"]
    coordinator = f"{topo.coordinator_ip}:{COORDINATOR_PORT}"
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("coordinator", "a", "b")}  # noqa: SIM115
    procs.start(
        ns["c"],
        [*python, "coordinator", "--listen", coordinator, "--state-dir", str(tmp_path / "state")],
        stdout=logs["coordinator"],
        stderr=subprocess.STDOUT,
    )
    for host in ("a", "b"):
        procs.start(
            ns[host],
            [*python, "stage", "--coordinator", coordinator, "--threads", "1",
             "--listen", f"{topo.shaped_ip[host]}:{STAGE_PORT}",
             "--models", "bench.bench_models", "--drain-timeout-s", "1"],
            own_shm=True, stdout=logs[host], stderr=subprocess.STDOUT,
        )  # fmt: skip
    client = procs.start(
        ns["c"],
        [sys.executable, __file__, coordinator],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert client.stdin is not None
    try:
        shaped = _answer(client)
        _shape(topo, "none")
        client.stdin.write("unshaped\n")
        client.stdin.flush()
        fast = _answer(client)
        assert client.wait(timeout=60) == 0
    finally:
        for log in logs.values():
            log.close()
        for pipe in (client.stdin, client.stdout):
            if pipe is not None:
                pipe.close()
    print(f"100 Mbit/s: {shaped}\nunshaped: {fast}")
    detail = f"{shaped}\n{fast}\n" + (tmp_path / "coordinator.log").read_text()[-3000:]
    assert shaped["probe"] == pytest.approx(LINK_BYTES_PER_S, rel=0.3), detail
    assert shaped["codecs"] == [["int8", "bfloat16"]], detail
    assert "the bottleneck: link" in shaped["reasons"][0], detail
    assert fast["probe"] > 3 * LINK_BYTES_PER_S, detail
    assert fast["codecs"] == [[None, None]], detail
    assert "not the bottleneck" in fast["reasons"][0], detail


def _client(coordinator: str) -> None:
    """In host ``c``: an ``auto`` job of ``bench/pipeline.py``'s activation-heavy MLP on the
    two stages; prints one JSON line per phase (the shaped link, then, once stdin says so, the
    unshaped one): a direct probe's rate, and the link's codecs and reason after a re-plan."""
    sys.path.insert(0, str(REPO))
    import time

    import torch

    import pipesvc
    from bench import pipeline as base
    from pipesvc.v1 import stage_pb2, stage_pb2_grpc
    from pipesvc.wire.transport import call, open_channel

    torch.set_num_threads(1)
    w = base.WORKLOADS["act"]
    x, y = base._batch(w)
    client = pipesvc.connect(coordinator, timeout_s=600)
    deadline = time.monotonic() + 120
    while True:  # the coordinator may not listen yet
        try:
            if sum(s.health == "SERVING" for s in client.stages()) >= 2:
                break
        except pipesvc.PipesvcError:
            pass
        if time.monotonic() > deadline:
            sys.exit("the stages did not register within 120 s")
        time.sleep(0.2)
    job = client.create_job(
        model=w.model,
        model_args=w.model_args,
        num_stages=2,
        num_microbatches=base.NUM_MICROBATCHES,
        optimizer={"name": "sgd", "lr": base.LR},
        loss=w.loss,
        partition="uniform",
        checkpoint_every=0,
        wire_dtype="auto",
    )
    for phase in range(2):
        if phase:
            sys.stdin.readline()
        for _ in range(3):
            job.train_step(x, y)
        source, target = (s.address for s in sorted(job.plan, key=lambda s: s.rank))
        with open_channel(source) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            probed = call(
                stub.ProbeLink,
                stage_pb2.ProbeLinkRequest(target=target),
                timeout_s=120,
                where=source,
            )
        job.replan("throughput")
        job.train_step(x, y)  # the decided codecs run
        answer = {
            "probe": probed.bytes_per_s,
            "codecs": [list(link.codecs) for link in job.links],
            "reasons": [link.reason for link in job.links],
        }
        print(json.dumps(answer), flush=True)
    job.close()
    client.close()


if __name__ == "__main__":
    _client(sys.argv[1])
