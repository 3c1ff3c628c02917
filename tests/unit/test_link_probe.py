"""The link probe's pure parts (see [Note: link probe] in pipesvc/stage/net/probe.py): how large
each send is, what a ``Sink`` accepts, which pairs of stages a measurement probes, that a
probed rate is the one ``auto`` and the planner read, and that a re-plan decides the links of
the ranges it keeps again. No gRPC here."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from pipesvc.coordinator.link_rates import LinkRates
from pipesvc.coordinator.rebalance import Replanner
from pipesvc.coordinator.stage_registry import StageRecord
from pipesvc.core.config import JobConfig
from pipesvc.core.link_codecs import links, wire_fraction
from pipesvc.core.plan import PipelineStage
from pipesvc.core.planning import throughput
from pipesvc.core.planning.measured import (
    MAX_PROBES,
    Decision,
    Measurements,
    measurements,
    probe_pairs,
)
from pipesvc.errors import InvalidArgumentError, StageUnavailableError
from pipesvc.stage.net import probe
from pipesvc.v1 import stage_pb2

MiB = 1 << 20


def test_sizes_grow_eightfold_until_a_send_takes_50_ms_or_reaches_the_cap() -> None:
    assert probe.next_bytes(MiB, 0.001) == 8 * MiB
    assert probe.next_bytes(8 * MiB, 0.0499) == 64 * MiB
    assert probe.next_bytes(MiB, 0.05) is None  # long enough: this send is the measurement
    assert probe.next_bytes(16 * MiB, 0.001) == probe.MAX_BYTES  # never past the cap
    assert probe.next_bytes(probe.MAX_BYTES, 0.001) is None


def _sizes(bytes_per_s: float) -> list[int]:
    """The sends a probe makes on a link of that rate (each takes size / rate)."""
    sizes: list[int] = []
    size: int | None = probe.FIRST_BYTES
    while size is not None:
        sizes.append(size)
        size = probe.next_bytes(size, size / bytes_per_s)
    return sizes


def test_a_slow_link_costs_one_send_and_a_fast_one_is_measured_on_the_largest() -> None:
    assert _sizes(12.5e6) == [MiB]  # 100 Mbit/s: 84 ms
    assert _sizes(125e6) == [MiB, 8 * MiB]  # 1 Gbit/s: 8 ms, then 67 ms
    assert _sizes(1.25e9) == [MiB, 8 * MiB, 64 * MiB]  # 10 Gbit/s: the cap, 54 ms
    assert _sizes(1e12) == [MiB, 8 * MiB, 64 * MiB]


def test_sink_frames_declare_the_total_once_and_carry_it_in_bounded_frames() -> None:
    frames = list(probe.sink_frames(probe.FRAME_BYTES * 2 + 5))
    assert [f.total_bytes for f in frames] == [probe.FRAME_BYTES * 2 + 5, 0, 0]
    assert [len(f.filler) for f in frames] == [probe.FRAME_BYTES, probe.FRAME_BYTES, 5]
    assert probe.receive(frames) == probe.FRAME_BYTES * 2 + 5


def _frame(total: int, size: int) -> stage_pb2.SinkFrame:
    return stage_pb2.SinkFrame(total_bytes=total, filler=b"x" * size)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([], "sent no frame"),
        ([_frame(0, 3)], "declares 0 bytes; expected 1 to 100"),
        ([_frame(101, 3)], "declares 101 bytes; expected 1 to 100"),
        ([_frame(4, 3), _frame(0, 3)], "more than the 4 bytes it declared"),
        ([_frame(10, 3), _frame(0, 3)], "ended after 6 of the 10 bytes"),
        ([_frame(10, 3), _frame(10, 3)], "after the first declares 10 bytes"),
    ],
)
def test_a_sink_refuses_bad_streams_with_typed_errors(
    frames: list[stage_pb2.SinkFrame], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        probe.receive(iter(frames), max_bytes=100)


def test_a_sink_refuses_an_oversized_stream_before_reading_its_filler() -> None:
    def frames() -> object:
        yield _frame(probe.MAX_BYTES + 1, 1)
        raise AssertionError("read past the refused first frame")

    with pytest.raises(InvalidArgumentError, match="expected 1 to"):
        probe.receive(frames())  # type: ignore[arg-type]


def _record(address: str) -> StageRecord:
    return StageRecord(address=address, device="cpu", memory_bytes=1 << 30, models=("mlp",))


def _plan(*addresses: str) -> list[PipelineStage]:
    return [
        PipelineStage(start_layer=r, end_layer=r + 1, rank=r, address=a)
        for r, a in enumerate(addresses)
    ]


def test_a_measurement_probes_the_plans_links_then_every_other_pair_of_hosts_once() -> None:
    plan = _plan("h1:1", "h1:2", "h2:1", "h3:1")
    records = [_record(s.address) for s in plan] + [_record("h4:1"), _record("h2:2")]
    assert probe_pairs(plan, records) == [
        ("h1:2", "h2:1"),  # the plan's links between hosts, in rank order (h1 -> h1: none)
        ("h2:1", "h3:1"),
        ("h1:1", "h3:1"),  # then the other pairs of hosts, from each host's first stage
        ("h1:1", "h4:1"),
        ("h2:1", "h4:1"),
        ("h3:1", "h4:1"),
    ]
    many = [_record(f"10.0.0.{i}:1") for i in range(10)]
    assert len(probe_pairs([], many)) == MAX_PROBES


def _profile(index: int) -> stage_pb2.StageProfile:
    return stage_pb2.StageProfile(
        layers=[stage_pb2.LayerTime(index=index, forward_s=1.0, output_bytes=100, flops=10)],
        send_bytes_per_s=8.6e9,  # what timing the send call reads on any link
    )


def test_the_probed_rate_is_the_links_rate_not_the_send_calls() -> None:
    plan = _plan("10.0.0.1:1", "10.0.0.2:1", "10.0.0.2:2")
    records = [_record(s.address) for s in plan] + [_record("10.0.0.3:1")]
    profiles = [_profile(0), _profile(1), _profile(2), stage_pb2.StageProfile(speed=1.0)]
    slow = {frozenset(("10.0.0.1", "10.0.0.2")): 12.5e6}
    measured = measurements(plan, 3, records, profiles, slow)
    assert measured.link_rates == slow
    # Rank 0's link is the probed one; rank 1's, on one host, its send calls'; the last
    # stage's and the free one's the median of the known.
    assert [r.link_bytes_per_s for r in measured.rates] == [12.5e6, 8.6e9, 4.30625e9, 4.30625e9]


LAYERS, BOUNDARY = 4, 4_000_000
AUTO = JobConfig(model="mlp", num_stages=2, wire_dtype="auto")


def _choose(current: list[PipelineStage], link_bytes_per_s: float) -> Decision:
    """``Replanner.choose("throughput")`` on ``current`` with a measurement made by hand: four
    layers of 1 s at speed 1 on two stages, the link between their hosts at that rate."""
    addresses = [s.address for s in current]
    stages = [
        StageRecord(address=a, device="cpu", memory_bytes=2**40, models=("mlp",)) for a in addresses
    ]
    rate = throughput.StageRate(speed=1.0, memory_bytes=2**40, link_bytes_per_s=link_bytes_per_s)
    costs = throughput.LayerCosts(work=[1.0] * LAYERS, boundary_bytes=[BOUNDARY] * LAYERS)
    ranges = [(s.start_layer, s.end_layer) for s in current]
    (link,) = links(AUTO, current)
    now = dataclasses.replace(rate, wire_fraction=wire_fraction(link.codecs, 4))
    measured = Measurements(
        costs,
        stages,
        [rate, rate],
        throughput.predict(costs, [now, rate], ranges),  # as measure() counts the codecs
        {frozenset(a.rpartition(":")[0] for a in addresses): link_bytes_per_s},
    )
    layers = [stage_pb2.LayerDescription(index=i, parameter_bytes=1) for i in range(LAYERS)]
    group: Any = SimpleNamespace(layers=layers, config=AUTO, plan=current, job_id="j")
    none: Any = None
    replanner = Replanner(group=group, ledger=none, checkpoints=none, recovery=none)
    replanner.measure = lambda **_: measured  # type: ignore[method-assign]
    return replanner.choose("throughput")


def _two(link_codec: str, reason: str = "") -> list[PipelineStage]:
    return [
        PipelineStage(
            start_layer=0,
            end_layer=2,
            rank=0,
            address="10.0.0.1:1",
            link_codec=link_codec,
            link_reason=reason,
        ),
        PipelineStage(start_layer=2, end_layer=4, rank=1, address="10.0.0.2:1"),
    ]


def test_a_replan_that_keeps_the_ranges_decides_their_links_again() -> None:
    compressed = "activations=int8,gradients=bfloat16"
    # Compressed while slow, now fast (8 ms both ways against 2 s of compute): back to exact,
    # although the exact plan is not predicted faster than the compressed one.
    fast = _choose(_two(compressed, "auto: int8 ... link 1 MB/s"), 1e9)
    assert fast.moved and [(s.start_layer, s.end_layer) for s in fast.plan] == [(0, 2), (2, 4)]
    assert fast.plan[0].link_codec == "exact"
    assert fast.plan[0].link_reason.startswith("auto: exact (not the bottleneck: link 1e+03 MB/s")
    # Same codecs, other figures in the reason: no move (a move costs a checkpoint).
    # (At 3.9 MB/s exact takes 2.05 s both ways, compressed 0.8 s: the uniform plan is best.)
    again = _choose(_two(compressed, "auto: int8 ... link 1 MB/s"), 3.9e6)
    assert not again.moved and again.plan[0].link_reason == "auto: int8 ... link 1 MB/s"
    # Never decided (exact until measured) and found fast: exact either way, no move.
    assert not _choose(_two(""), 1e9).moved


def test_a_probed_rate_is_kept_for_its_age_for_the_pair_of_hosts_either_way() -> None:
    now = [0.0]
    cache = LinkRates(max_age_s=300.0, clock=lambda: now[0])
    pair = frozenset(("10.0.0.1", "10.0.0.2"))
    assert cache.fresh(pair) is None
    cache.record(pair, 12.5e6)
    now[0] = 299.0
    assert cache.fresh(frozenset(("10.0.0.2", "10.0.0.1"))) == 12.5e6
    now[0] = 300.0
    assert cache.fresh(pair) is None and len(cache) == 0  # too old: probed again


class _Stage:
    """A stage's stub that answers ``ProbeLink`` with a fixed rate (or fails), counting calls."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self.probes: list[str] = []

    def ProbeLink(
        self, request: stage_pb2.ProbeLinkRequest, timeout: float
    ) -> stage_pb2.ProbeLinkResponse:
        self.probes.append(request.target)
        if self.bytes_per_s is None:
            raise StageUnavailableError("gone")
        return stage_pb2.ProbeLinkResponse(bytes_per_s=self.bytes_per_s, bytes=1, seconds=1.0)


def test_measurements_probe_each_pair_of_hosts_once_per_age_and_retry_failed_ones() -> None:
    now = [0.0]
    stubs = {"10.0.0.1:1": _Stage(12.5e6), "10.0.0.3:1": _Stage(None)}
    registry = SimpleNamespace(
        link_rates=LinkRates(max_age_s=300.0, clock=lambda: now[0]), stub=stubs.__getitem__
    )
    deadlines = SimpleNamespace(control_s=1.0)
    group: Any = SimpleNamespace(registry=registry, deadlines=deadlines, job_id="j")
    none: Any = None
    replanner = Replanner(group=group, ledger=none, checkpoints=none, recovery=none)
    pairs = [("10.0.0.1:1", "10.0.0.2:1"), ("10.0.0.3:1", "10.0.0.2:1")]
    slow = frozenset(("10.0.0.1", "10.0.0.2"))
    assert replanner._probe_links(pairs) == {slow: 12.5e6}
    # Another job's stage on the same hosts: the rate is known, nothing is probed; the pair
    # whose probe failed is tried again.
    assert replanner._probe_links([("10.0.0.2:7", "10.0.0.1:5"), *pairs[1:]]) == {slow: 12.5e6}
    assert stubs["10.0.0.1:1"].probes == ["10.0.0.2:1"]
    assert stubs["10.0.0.3:1"].probes == ["10.0.0.2:1", "10.0.0.2:1"]
    now[0] = 301.0  # too old: probed again
    assert replanner._probe_links(pairs[:1]) == {slow: 12.5e6}
    assert stubs["10.0.0.1:1"].probes == ["10.0.0.2:1", "10.0.0.2:1"]
    # A re-plan the user asks for probes again however fresh the rate, and keeps the new one.
    stubs["10.0.0.1:1"].bytes_per_s = 125e6
    assert replanner._probe_links(pairs[:1], probe_again=True) == {slow: 125e6}
    assert replanner._probe_links(pairs[:1]) == {slow: 125e6}
    assert len(stubs["10.0.0.1:1"].probes) == 3
