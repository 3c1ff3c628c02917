"""The link probe on real stage servers on hosts of their own (see [Note: link probe] in
pipesvc/stage/net/probe.py): a stage measures its link to another by ``ProbeLink`` and reads a
positive rate; a ``Sink`` refuses bad streams with typed errors and keeps serving; a job whose
re-plan probes its links trains exactly like one process. (What ``auto`` decides from a probed
rate on a real slow link: tests/cluster/test_link_probe_shaped.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

import pipesvc
from pipesvc.errors import InvalidArgumentError, PipesvcError
from pipesvc.stage.net import probe
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from pipesvc.wire.transport import call
from tests.support.reference import PROBLEMS, Reference

NUM_MICROBATCHES = 4
OPTIMIZER = {"name": "sgd", "lr": 0.1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[pipesvc.LocalCluster]:
    with pipesvc.LocalCluster(num_stages=2, threads_per_stage=1, separate_hosts=True) as started:
        yield started


@pytest.fixture(scope="module")
def stubs(cluster: pipesvc.LocalCluster) -> Iterator[list[stage_pb2_grpc.StageServiceStub]]:
    with cluster.connect() as client:
        addresses = sorted(s.address for s in client.stages())
    channels = [grpc.insecure_channel(a) for a in addresses]
    yield [stage_pb2_grpc.StageServiceStub(c) for c in channels]
    for channel in channels:
        channel.close()


def _addresses(cluster: pipesvc.LocalCluster) -> list[str]:
    with cluster.connect() as client:
        return sorted(s.address for s in client.stages())


def test_a_stage_probes_its_link_to_another_and_reads_a_positive_rate(
    cluster: pipesvc.LocalCluster, stubs: list[stage_pb2_grpc.StageServiceStub]
) -> None:
    a, b = _addresses(cluster)
    assert a.split(":")[0] != b.split(":")[0]  # two hosts
    answer = call(stubs[0].ProbeLink, stage_pb2.ProbeLinkRequest(target=b), timeout_s=120, where=a)
    assert answer.bytes_per_s > 0 and answer.rounds >= 1
    assert answer.bytes_per_s == pytest.approx(answer.bytes / answer.seconds)
    assert probe.FIRST_BYTES <= answer.bytes <= probe.MAX_BYTES


def test_bad_probes_and_sink_streams_get_typed_errors_and_the_stage_keeps_serving(
    cluster: pipesvc.LocalCluster, stubs: list[stage_pb2_grpc.StageServiceStub]
) -> None:
    a, b = _addresses(cluster)
    sink = stubs[1].Sink
    bad_streams = [
        [stage_pb2.SinkFrame(total_bytes=probe.MAX_BYTES + 1, filler=b"x")],
        [stage_pb2.SinkFrame(total_bytes=0, filler=b"x")],
        [stage_pb2.SinkFrame(total_bytes=2, filler=b"xyz")],
        [stage_pb2.SinkFrame(total_bytes=10, filler=b"xyz")],
        [],
    ]
    for frames in bad_streams:
        with pytest.raises(InvalidArgumentError, match="link probe"):
            call(sink, iter(frames), timeout_s=30, where=b)
    with pytest.raises(InvalidArgumentError, match="HOST:PORT"):
        call(
            stubs[0].ProbeLink, stage_pb2.ProbeLinkRequest(target="nowhere"), timeout_s=30, where=a
        )
    with pytest.raises(PipesvcError):  # nothing listens there
        call(
            stubs[0].ProbeLink,
            stage_pb2.ProbeLinkRequest(target="127.0.0.1:1"),
            timeout_s=60,
            where=a,
        )
    good = call(sink, probe.sink_frames(3 * probe.FRAME_BYTES + 1), timeout_s=30, where=b)
    assert good.received_bytes == 3 * probe.FRAME_BYTES + 1
    again = call(stubs[1].ProbeLink, stage_pb2.ProbeLinkRequest(target=a), timeout_s=120, where=b)
    assert again.bytes_per_s > 0


def test_a_replan_that_probes_the_links_trains_like_one_process(
    cluster: pipesvc.LocalCluster,
) -> None:
    problem = PROBLEMS["gpt"]
    reference = Reference(problem, seed=3, optimizer=OPTIMIZER, clip_grad_norm=None)
    with (
        cluster.connect() as client,
        client.create_job(
            model=problem.model,
            model_args=problem.model_args,
            seed=3,
            num_stages=2,
            num_microbatches=NUM_MICROBATCHES,
            optimizer=OPTIMIZER,
            loss=problem.loss,
            partition="uniform",
        ) as job,
    ):
        for step in range(4):
            x, y = problem.batch(8, seed=step)
            loss = job.train_step(x, y)
            assert loss == pytest.approx(reference.step(x, y, NUM_MICROBATCHES), rel=1e-5)
            if step == 1:
                measured = job.replan("throughput")  # probes the link between the two hosts
                assert len(measured.current_s) == 2
        weights = job.state_dict()
        for key, value in reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5)
