"""Which codec each link uses (pipesvc.core.link_codecs)."""

from __future__ import annotations

from pipesvc.core.config import JobConfig
from pipesvc.core.link_codecs import crosses_hosts, host_of, links, stage_codecs
from pipesvc.core.plan import PipelineStage


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
