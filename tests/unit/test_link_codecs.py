"""Which codec each link uses (pipesvc.core.link_codecs)."""

from __future__ import annotations

import pytest

from pipesvc.core import quant
from pipesvc.core.config import (
    JobConfig,
    config_from_dict,
    config_from_proto,
    config_to_dict,
    config_to_proto,
)
from pipesvc.core.link_codecs import (
    AUTO_CODECS,
    HOLD,
    LinkMeasure,
    choose_auto,
    crosses_hosts,
    fixed_codecs,
    host_of,
    link_codec_text,
    links,
    stage_codecs,
    wire_fraction,
)
from pipesvc.core.plan import PipelineStage, plan_from_dicts, plan_to_dicts
from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import common_pb2


def _plan(*addresses: str, chunks: int = 1) -> list[PipelineStage]:
    n = len(addresses)
    return [
        PipelineStage(start_layer=c * n + r, end_layer=c * n + r + 1, rank=r, address=a, chunk=c)
        for c in range(chunks)
        for r, a in enumerate(addresses)
    ]


def test_hosts_are_compared_without_ports_and_brackets() -> None:
    assert host_of("10.0.0.1:5000") == "10.0.0.1"
    assert host_of("[::1]:5000") == "::1"
    assert not crosses_hosts("10.0.0.1:5000", "10.0.0.1:5001")
    assert crosses_hosts("10.0.0.1:5000", "10.0.0.2:5000")


def test_only_links_between_hosts_take_the_jobs_codec() -> None:
    config = JobConfig(model="mlp", num_stages=3, wire_dtype={"activations": "int8"})
    plan = _plan("a:1", "a:2", "b:1")
    found = links(config, plan)
    assert [(x.source, x.between_hosts, x.codecs) for x in found] == [
        (0, False, (None, None)),
        (1, True, ("int8", None)),
    ]
    assert stage_codecs(config, plan, 0) == ((None, None), (None, None))
    assert stage_codecs(config, plan, 1) == ((None, None), ("int8", None))
    assert stage_codecs(config, plan, 2) == (("int8", None), (None, None))
    assert "rank 1 -> 2: between hosts, activations int8, gradients exact" in [
        x.describe(3) for x in found
    ]


def test_a_link_on_one_host_keeps_the_precisions_own_dtype() -> None:
    config = JobConfig(model="mlp", wire_dtype="int4", precision="bf16-mixed")
    found = links(config, _plan("a:1", "a:2", "b:1"))
    assert [x.codecs for x in found] == [("bfloat16", "bfloat16"), ("int4", "int4")]


def test_virtual_stages_add_the_link_from_the_last_rank_back_to_the_first() -> None:
    config = JobConfig(
        model="mlp", num_stages=2, virtual_stages=2, schedule="interleaved-1f1b", wire_dtype="int8"
    )
    plan = _plan("a:1", "b:1", chunks=2)
    found = links(config, plan)
    assert [(x.source, x.target % 2, x.codecs) for x in found] == [
        (0, 1, ("int8", "int8")),
        (1, 0, ("int8", "int8")),
    ]
    assert stage_codecs(config, plan, 0) == (("int8", "int8"), ("int8", "int8"))


def test_one_stage_has_no_links() -> None:
    assert links(JobConfig(model="mlp", num_stages=1, wire_dtype="int8"), _plan("a:1")) == []


# wire_dtype="auto" (see [Note: automatic codecs]).

MB = 1e6


def _measure(
    *,
    between: bool = True,
    rate: float | None = 12 * MB,
    compute: tuple[float, float] = (0.01, 0.02),
    compressed: bool = False,
) -> LinkMeasure:
    return LinkMeasure(
        between_hosts=between,
        boundary_bytes=4 * 2**20,
        link_bytes_per_s=rate,
        compute_s=compute,
        compressed=compressed,
    )


def test_auto_compresses_a_link_between_hosts_that_is_the_bottleneck() -> None:
    # 2 x 4 MiB at 12 MB/s: 0.7 s per micro-batch, the stages compute 10 and 20 ms.
    codecs, why = choose_auto(_measure())
    assert codecs == AUTO_CODECS == ("int8", "bfloat16")
    assert why.startswith(
        "auto: int8 activations, bfloat16 gradients (the bottleneck: link 12 MB/s"
    )


def test_auto_keeps_a_link_exact_when_the_slower_stage_outlasts_it() -> None:
    # 2 x 4 MiB at 1 GB/s: 8.4 ms; the downstream stage computes 20 ms.
    codecs, why = choose_auto(_measure(rate=1000 * MB))
    assert codecs == (None, None)
    assert why.startswith("auto: exact (not the bottleneck: link 1e+03 MB/s")
    # The slower of the two stages counts: with both at 5 ms the same link is the bottleneck.
    assert choose_auto(_measure(rate=1000 * MB, compute=(0.005, 0.005)))[0] == AUTO_CODECS


def test_a_compressed_link_goes_back_to_exact_only_well_below_the_threshold() -> None:
    transfer = 2 * 4 * 2**20 / (1000 * MB)  # 8.4 ms both ways, exact
    just_faster = (0.9 * transfer, transfer / 0.95)  # the slower stage: 5% over the transfer
    assert choose_auto(_measure(rate=1000 * MB, compute=just_faster))[0] == (None, None)
    codecs, why = choose_auto(_measure(rate=1000 * MB, compute=just_faster, compressed=True))
    assert codecs == AUTO_CODECS and why.startswith(
        "auto: int8 activations, bfloat16 gradients (kept"
    )
    well_below = (0.5 * transfer, transfer / (HOLD - 0.05))
    assert choose_auto(_measure(rate=1000 * MB, compute=well_below, compressed=True))[0] == (
        None,
        None,
    )


def test_auto_keeps_links_on_one_host_and_unmeasured_links_exact() -> None:
    assert choose_auto(_measure(between=False, rate=1.0)) == (
        (None, None),
        "auto: exact (one host)",
    )
    for rate in (None, 0.0, float("inf")):
        assert choose_auto(_measure(rate=rate)) == (
            (None, None),
            "auto: exact (link not measured yet)",
        )


def test_a_new_auto_job_starts_exact_on_every_link() -> None:
    config = JobConfig(model="mlp", num_stages=3, wire_dtype="auto")
    assert config.wire_dtype == "auto"
    assert config.wire_codecs == (None, None)
    found = links(config, _plan("a:1", "a:2", "b:1"))
    assert [(x.between_hosts, x.codecs, x.reason) for x in found] == [
        (False, (None, None), "auto: exact (one host)"),
        (True, (None, None), "auto: exact until measured"),
    ]
    bf16 = JobConfig(model="mlp", wire_dtype="auto", precision="bf16")
    assert bf16.wire_codecs == ("bfloat16", "bfloat16")


def test_auto_is_checked_and_round_trips() -> None:
    config = JobConfig(model="mlp", wire_dtype="auto")
    assert config_from_proto(config_to_proto(config)) == config
    assert config_from_dict(config_to_dict(config)) == config
    with pytest.raises(
        InvalidArgumentError, match=r"wire_dtype 'automatic' is not supported.*'auto'"
    ):
        JobConfig(model="mlp", wire_dtype="automatic")
    with pytest.raises(InvalidArgumentError, match="codec 'auto' is not supported"):
        JobConfig(model="mlp", wire_dtype={"activations": "auto"})


def test_a_plans_link_codec_overrides_the_host_rule_on_both_ends() -> None:
    config = JobConfig(model="mlp", num_stages=3, wire_dtype="auto")
    plan = _plan("a:1", "b:1", "c:1")
    plan[1] = PipelineStage(
        start_layer=1,
        end_layer=2,
        rank=1,
        address="b:1",
        link_codec=link_codec_text(AUTO_CODECS),
        link_reason="auto: int8 (slow)",
    )
    found = links(config, plan)
    assert [(x.codecs, x.reason) for x in found] == [
        ((None, None), "auto: exact until measured"),
        (("int8", "bfloat16"), "auto: int8 (slow)"),
    ]
    assert "gradients bfloat16 (auto: int8 (slow))" in found[1].describe(3)
    # Both ends of the link read the same codecs from the plan.
    assert stage_codecs(config, plan, 1)[1] == stage_codecs(config, plan, 2)[0] == AUTO_CODECS
    assert stage_codecs(config, plan, 0) == ((None, None), (None, None))


def test_link_codec_text_and_its_reading() -> None:
    config = JobConfig(model="mlp")
    assert link_codec_text((None, None)) == "exact"
    assert link_codec_text(("int8", "bfloat16")) == "activations=int8,gradients=bfloat16"
    assert link_codec_text(("int4", "int4")) == "int4"
    assert fixed_codecs(config, "activations=int8,gradients=bfloat16") == ("int8", "bfloat16")
    assert fixed_codecs(config, "exact") == (None, None)
    assert fixed_codecs(JobConfig(model="mlp", precision="bf16"), "exact") == (
        "bfloat16",
        "bfloat16",
    )
    for bad in ("int3", "auto", ""):
        with pytest.raises(InvalidArgumentError, match="plan link_codec"):
            fixed_codecs(config, bad)


def test_wire_fraction_counts_both_directions_in_their_codecs() -> None:
    assert wire_fraction((None, None), 4) == 1.0
    assert wire_fraction(("bfloat16", "bfloat16"), 4) == 0.5
    n = quant.DEFAULT_BLOCK * 1024
    expected = (quant.wire_bytes(n, "int8") + 2 * n) / (2 * 4 * n)
    assert wire_fraction(AUTO_CODECS, 4) == pytest.approx(expected)
    assert wire_fraction(AUTO_CODECS, 4) == pytest.approx((1 + 4 / 64 + 2) / 8)


def test_the_plan_fields_round_trip_through_the_wire_and_json() -> None:
    stage = PipelineStage(
        start_layer=0,
        end_layer=3,
        rank=0,
        address="a:1",
        link_codec="activations=int8,gradients=bfloat16",
        link_reason="auto: int8 activations, bfloat16 gradients (the bottleneck)",
    )
    wire = common_pb2.PlanStage.FromString(stage.to_proto().SerializeToString())
    assert PipelineStage.from_proto(wire) == stage
    assert plan_from_dicts(plan_to_dicts([stage])) == [stage]
    plain = PipelineStage(start_layer=0, end_layer=3, rank=0, address="a:1")
    # A plan without the fields (every plan before them) reads and writes as before.
    assert plain.to_dict() == {
        "start_layer": 0,
        "end_layer": 3,
        "rank": 0,
        "address": "a:1",
        "replica": 0,
        "chunk": 0,
    }
    assert PipelineStage.from_proto(plain.to_proto()) == plain
    with pytest.raises(InvalidArgumentError, match=r"link_codec \(8\) must be a string"):
        PipelineStage.from_dict({**plain.to_dict(), "link_codec": 8})
