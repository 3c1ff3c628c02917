"""Which codec each link between stages uses: exact on a host, the job's codec between hosts.

[Note: codecs per link] A link between two stages on the same host is memory to memory (shared
memory, or loopback when that is off): compressing it would cost precision and CPU and save
nothing. So ``JobConfig.wire_dtype`` applies only to links whose two ends have different hosts
in their plan addresses (the host part of ``host:port``, compared as text: a stage that
advertises ``localhost`` and one that advertises ``127.0.0.1`` count as two hosts, which costs
speed, never correctness). A link on one host still carries the precision's own dtype
(bfloat16 under the bf16 precisions, see [Note: wire dtype] in ``pipesvc.stage.runtime``).

Both ends of a link, the coordinator and the client compute the same answer from the plan, so
the choice needs no message of its own and is the same after every re-plan that keeps the
addresses; the one-process reference applies a boundary's codec exactly where this says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipesvc.core.config import JobConfig
from pipesvc.core.plan import PipelineStage

Codecs = tuple[str | None, str | None]
"""(activations, gradients): what each crosses a link in; None: exact."""


def host_of(address: str) -> str:
    """The host part of ``host:port`` (brackets of an IPv6 address dropped)."""
    return address.rpartition(":")[0].strip("[]")


def crosses_hosts(a: str, b: str) -> bool:
    """Whether a link between the stages at addresses ``a`` and ``b`` leaves a host."""
    return host_of(a) != host_of(b)


def codecs_for(config: JobConfig, between_hosts: bool) -> Codecs:
    """The codecs of one link of ``config``'s job (see [Note: codecs per link])."""
    if between_hosts:
        return config.wire_codecs
    own = "bfloat16" if config.precision != "fp32" else None
    return (own, own)


@dataclass(frozen=True, slots=True)
class Link:
    """The link from rank ``source`` to rank ``source + 1`` (mod the stages: the last rank
    sends back to rank 0 when the job has virtual stages)."""

    source: int
    between_hosts: bool
    codecs: Codecs

    @property
    def target(self) -> int:
        return self.source + 1

    def describe(self, num_stages: int) -> str:
        a, g = (c or "exact" for c in self.codecs)
        where = "between hosts" if self.between_hosts else "on one host"
        return (
            f"rank {self.source} -> {self.target % num_stages}: {where}, activations {a}, "
            f"gradients {g}"
        )


def links(config: JobConfig, pipeline: Sequence[PipelineStage]) -> list[Link]:
    """Each link of one pipeline (one replica's stages; each server once, its chunk 0), in
    rank order; with virtual stages, the last one goes from the last rank back to rank 0."""
    servers = sorted((s for s in pipeline if s.chunk == 0), key=lambda s: s.rank)
    count = len(servers) if config.virtual_stages > 1 and len(servers) > 1 else len(servers) - 1
    result = []
    for rank in range(max(count, 0)):
        a, b = servers[rank].address, servers[(rank + 1) % len(servers)].address
        between = crosses_hosts(a, b)
        result.append(Link(rank, between, codecs_for(config, between)))
    return result


def stage_codecs(
    config: JobConfig, pipeline: Sequence[PipelineStage], rank: int
) -> tuple[Codecs, Codecs]:
    """(upstream, downstream): the codecs of the links into and out of rank ``rank`` (a stage
    with no such link gets its precision's own, which nothing uses)."""
    by_source = {link.source: link.codecs for link in links(config, pipeline)}
    num = len({s.rank for s in pipeline})
    own = codecs_for(config, between_hosts=False)
    return by_source.get((rank - 1) % num, own), by_source.get(rank, own)
