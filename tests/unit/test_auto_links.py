"""``wire_dtype="auto"`` in the re-planner: each link of the chosen plan gets its codecs by the
rule of [Note: automatic codecs] (pipesvc/core/link_codecs.py), the ranges are chosen with the
links' bytes counted in those codecs, and a spare that replaces a lost stage keeps them. Pure:
measurements made by hand, no gRPC."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from pipesvc.coordinator.planner import keep_link_codecs
from pipesvc.coordinator.rebalance import Replanner
from pipesvc.coordinator.stage_registry import StageRecord
from pipesvc.core.config import JobConfig
from pipesvc.core.link_codecs import AUTO_CODECS, links, wire_fraction
from pipesvc.core.plan import PipelineStage
from pipesvc.core.planning import throughput
from pipesvc.core.planning.measured import Measurements, decide_links
from pipesvc.v1 import stage_pb2

LAYERS = 4
BOUNDARY = 4_000_000
"""Bytes of every layer's output per micro-batch."""


def _measured(
    addresses: list[str], link_bytes_per_s: float, *, known: bool = True, layers: int = LAYERS
) -> Measurements:
    """``layers`` layers of 1 s each at speed 1, every stage of speed 1 with a link of that
    rate."""
    stages = [
        StageRecord(address=a, device="cpu", memory_bytes=2**40, models=("mlp",)) for a in addresses
    ]
    rates = [
        throughput.StageRate(speed=1.0, memory_bytes=2**40, link_bytes_per_s=link_bytes_per_s)
        for _ in addresses
    ]
    costs = throughput.LayerCosts(work=[1.0] * layers, boundary_bytes=[BOUNDARY] * layers)
    hosts = [a.rpartition(":")[0] for a in addresses]
    measured = {frozenset(pair): link_bytes_per_s for pair in itertools.pairwise(hosts)}
    return Measurements(costs, stages, rates, [], measured if known else {})


def _plan(*addresses: str) -> list[PipelineStage]:
    per = LAYERS // len(addresses)
    return [
        PipelineStage(start_layer=r * per, end_layer=(r + 1) * per, rank=r, address=a)
        for r, a in enumerate(addresses)
    ]


def _replanner(config: JobConfig, measured: Measurements) -> Replanner:
    count = len(measured.costs.work)
    layers = [stage_pb2.LayerDescription(index=i, parameter_bytes=1) for i in range(count)]
    group: Any = SimpleNamespace(layers=layers, config=config)
    none: Any = None
    replanner = Replanner(group=group, ledger=none, checkpoints=none, recovery=none)
    return replanner


CONFIG = JobConfig(model="mlp", num_stages=2, wire_dtype="auto")


def test_a_slow_link_between_hosts_is_compressed_and_a_fast_one_is_not() -> None:
    plan = _plan("10.0.0.1:1", "10.0.0.2:1")
    # 2 x 4 MB at 1 MB/s: 8 s per micro-batch both ways; each stage computes 2 s.
    slow = decide_links(CONFIG, plan, _measured([s.address for s in plan], 1e6))
    assert [(s.link_codec, s.link_reason.split(" (")[0]) for s in slow] == [
        ("activations=int8,gradients=bfloat16", "auto: int8 activations, bfloat16 gradients"),
        ("", ""),
    ]
    assert [link.codecs for link in links(CONFIG, slow)] == [AUTO_CODECS]
    # At 1 GB/s: 8 ms, under the stages' 2 s.
    fast = decide_links(CONFIG, plan, _measured([s.address for s in plan], 1e9))
    assert fast[0].link_codec == "exact"
    assert fast[0].link_reason.startswith("auto: exact (not the bottleneck: link 1e+03 MB/s")


def test_a_plan_that_reverses_two_stages_knows_their_links_rate() -> None:
    # Measured from 10.0.0.1 to 10.0.0.2; the new plan sends from 10.0.0.2 to 10.0.0.1.
    measured = _measured(["10.0.0.1:1", "10.0.0.2:1"], 1e6)
    reversed_plan = _plan("10.0.0.2:1", "10.0.0.1:1")
    decided = decide_links(CONFIG, reversed_plan, measured)
    assert decided[0].link_codec == "activations=int8,gradients=bfloat16"
    # A third host nobody measured a link to stays exact.
    three = _measured(["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"], 1e6)
    three = dataclasses.replace(three, link_rates=measured.link_rates)
    other = decide_links(CONFIG, _plan("10.0.0.3:1", "10.0.0.1:1"), three)
    assert other[0].link_reason == "auto: exact (link not measured yet)"


def test_one_host_and_unmeasured_links_stay_exact() -> None:
    same = _plan("10.0.0.1:1", "10.0.0.1:2")
    decided = decide_links(CONFIG, same, _measured([s.address for s in same], 1e3))
    assert (decided[0].link_codec, decided[0].link_reason) == ("exact", "auto: exact (one host)")
    apart = _plan("10.0.0.1:1", "10.0.0.2:1")
    unknown = decide_links(CONFIG, apart, _measured([s.address for s in apart], 1e3, known=False))
    assert unknown[0].link_reason == "auto: exact (link not measured yet)"


def test_the_auto_plan_counts_the_compressed_link_in_its_codecs() -> None:
    addresses = ["10.0.0.1:1", "10.0.0.2:1"]
    measured = _measured(addresses, 1e6)
    plan, predicted = _replanner(CONFIG, measured)._auto_plan(CONFIG, measured)
    # The link's time is rank 0's, so rank 0 takes one layer: 1 s + the link, against 3 s.
    assert [(s.start_layer, s.end_layer) for s in plan] == [(0, 1), (1, 4)]
    assert plan[0].link_codec == "activations=int8,gradients=bfloat16"
    link_s = 2 * BOUNDARY * wire_fraction(AUTO_CODECS, 4) / 1e6
    assert predicted == pytest.approx([1.0 + link_s, 3.0])
    # A fast link: exact, and the prediction counts it exact.
    fast = _measured(addresses, 1e9)
    plan, predicted = _replanner(CONFIG, fast)._auto_plan(CONFIG, fast)
    assert plan[0].link_codec == "exact"
    assert predicted == pytest.approx([2.0 + 2 * BOUNDARY / 1e9, 2.0])


def test_the_ranges_are_chosen_with_the_compressed_links_bytes() -> None:
    addresses = ["10.0.0.1:1", "10.0.0.2:1"]
    # Six layers of 1 s; the link takes 6 s both ways exact, 2.3 s in int8 and bfloat16.
    measured = _measured(addresses, 2 * BOUNDARY / 6.0, layers=6)
    plan, predicted = _replanner(CONFIG, measured)._auto_plan(CONFIG, measured)
    # Exact, rank 0 would take one layer (7 s against 5 s); with the link compressed it
    # takes two (2 s + 2.3 s against 4 s).
    assert [(s.start_layer, s.end_layer) for s in plan] == [(0, 2), (2, 6)]
    assert plan[0].link_codec == "activations=int8,gradients=bfloat16"
    assert predicted == pytest.approx([2.0 + 6.0 * wire_fraction(AUTO_CODECS, 4), 4.0])


def test_a_spare_in_a_lost_stages_place_keeps_its_links_codecs() -> None:
    old = decide_links(
        CONFIG, _plan("10.0.0.1:1", "10.0.0.2:1"), _measured(["10.0.0.1:1", "10.0.0.2:1"], 1e6)
    )
    spare = _plan("10.0.0.3:1", "10.0.0.2:1")
    kept = keep_link_codecs(old, spare)
    assert [(s.address, s.link_codec) for s in kept] == [
        ("10.0.0.3:1", "activations=int8,gradients=bfloat16"),
        ("10.0.0.2:1", ""),
    ]
    recut = [
        PipelineStage(start_layer=0, end_layer=1, rank=0, address="10.0.0.3:1"),
        PipelineStage(start_layer=1, end_layer=4, rank=1, address="10.0.0.2:1"),
    ]
    assert keep_link_codecs(old, recut) == recut
