"""Which codec each link between stages uses: exact on a host, the job's codec between hosts,
or, under ``wire_dtype="auto"``, what the plan fixed for the link by measurement.

[Note: codecs per link] A link between two stages on the same host is memory to memory (shared
memory, or loopback when that is off): compressing it would cost precision and CPU and save
nothing. So ``JobConfig.wire_dtype`` applies only to links whose two ends have different hosts
in their plan addresses (the host part of ``host:port``, compared as text: a stage that
advertises ``localhost`` and one that advertises ``127.0.0.1`` count as two hosts, which costs
speed, never correctness). A link on one host still carries the precision's own dtype
(bfloat16 under the bf16 precisions, see [Note: wire dtype] in
``pipesvc.stage.compute.wire_casts``).

Both ends of a link, the coordinator and the client compute the same answer from the plan, so
the choice needs no message of its own and is the same after every re-plan that keeps the
addresses; the one-process reference applies a boundary's codec exactly where this says. A
plan entry whose ``link_codec`` is set overrides the rule for the link out of that stage (see
[Note: automatic codecs]).

[Note: automatic codecs] ``wire_dtype="auto"`` compresses a link only where the link is what
the step waits for. With the throughput model (see [Note: throughput plan] in
``pipesvc.core.planning.throughput``), a link between hosts is the bottleneck when moving one
micro-batch's activation forward and its gradient back at the exact dtype, at the link's
measured rate (bytes per second that reach the downstream stage, see below), takes longer than
the slower of its two stages computes one micro-batch:

    2 * boundary_bytes / link_bytes_per_s  >  max(compute_s[upstream], compute_s[downstream])

Such a link gets ``AUTO_CODECS``, int8 activations and bfloat16 gradients (the quality runs of
``bench/codecs.py`` put that pair within the noise floor of float32); every other link stays
exact: one on a host, one whose rate nobody measured yet, one faster than its stages. A new job
has no measurement, so it starts exact everywhere; the decision is made where the job is
measured, by the re-planner (``job.replan("throughput")``, the throughput partition's probe and
``rebalance``), on the plan it chooses, and the throughput planner counts each link's bytes in
the codec it would get (see ``Replanner.choose``). The answer goes into the plan
(``PipelineStage.link_codec`` and ``link_reason``): both ends of the link, the coordinator, the
client and the one-process reference read it from there, it survives a coordinator restart with
the plan, and it changes only with the plan, at a new plan epoch between two steps, never
within a step. A spare that takes a lost stage's place in the same cuts keeps the codecs of
its links (so the replayed steps compute what they computed); a re-partition, by recovery or
by a re-plan with another method, starts the new plan's links exact again until the next
measurement. A job with replicas or virtual stages is never re-planned, so its links stay
exact under ``auto``. A compressed link whose exact transfer falls back below its stages'
compute stays compressed until the transfer takes less than ``HOLD`` (80%) of the slower
stage's compute: near the threshold, measurement noise would otherwise flip the link at every
re-plan, and each flip is a new plan epoch.

The measured rate is the link probe's (see [Note: link probe] in ``pipesvc.stage.net.probe``):
bytes that arrived at the downstream stage per second of a send of filler timed to its
answer, probed by the re-planner when it measures. (A stage's own ``send_bytes_per_s`` times
the send call, a put into the sender's queue; it reads gigabytes per second on any link, so
``auto`` decided by it never compressed a real slow link.) A re-plan that keeps its ranges
decides their links again, so a link that became fast goes back to exact. The rule does not
depend on where the rate comes from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipesvc.core import quant
from pipesvc.core.config import JobConfig
from pipesvc.core.job_sections import WIRE_AUTO, canonical_wire, wire_roles
from pipesvc.core.plan import PipelineStage
from pipesvc.errors import InvalidArgumentError

Codecs = tuple[str | None, str | None]
"""(activations, gradients): what each crosses a link in; None: exact."""


def host_of(address: str) -> str:
    """The host part of ``host:port`` (brackets of an IPv6 address dropped)."""
    return address.rpartition(":")[0].strip("[]")


def crosses_hosts(a: str, b: str) -> bool:
    """Whether a link between the stages at addresses ``a`` and ``b`` leaves a host."""
    return host_of(a) != host_of(b)


AUTO_CODECS: Codecs = ("int8", "bfloat16")
"""What ``wire_dtype="auto"`` sends a bottleneck link's activations and gradients in."""
EXACT = "exact"
"""``PipelineStage.link_codec`` of a link fixed exact (the precision's own dtype)."""


def codecs_for(config: JobConfig, between_hosts: bool) -> Codecs:
    """The codecs of one link of ``config``'s job by the host rule (see [Note: codecs per
    link])."""
    if between_hosts:
        return config.wire_codecs
    own = "bfloat16" if config.precision != "fp32" else None
    return (own, own)


def link_codec_text(codecs: Codecs) -> str:
    """``PipelineStage.link_codec`` for ``codecs``: ``"exact"`` or a ``wire_dtype`` text."""
    if codecs == (None, None):
        return EXACT
    text = canonical_wire({"activations": codecs[0], "gradients": codecs[1]})
    assert text is not None
    return text


def fixed_codecs(config: JobConfig, text: str) -> Codecs:
    """The codecs a plan entry's ``link_codec`` ``text`` fixes for ``config``'s job (exact is
    the precision's own dtype, as on one host).

    Raises:
        InvalidArgumentError: ``text`` is not ``"exact"`` or a ``wire_dtype`` text.
    """
    if text == EXACT:
        return codecs_for(config, between_hosts=False)
    try:
        canonical = canonical_wire(text)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"plan link_codec {text!r} must be 'exact' or a wire_dtype text such as "
            f"'activations=int8,gradients=bfloat16': {exc}"
        ) from exc
    if canonical in (None, WIRE_AUTO):
        raise InvalidArgumentError(
            f"plan link_codec {text!r} must name codecs ('exact', 'int8', ...), not {canonical!r}"
        )
    a, g = wire_roles(canonical)
    if config.precision == "fp32":
        return (a, g)
    return (a or "bfloat16", g or "bfloat16")


def wire_fraction(codecs: Codecs, itemsize: int) -> float:
    """Bytes a link sends per byte of the exact activation (of ``itemsize`` bytes a value),
    averaged over both directions (an activation forward, its gradient back)."""
    n = quant.DEFAULT_BLOCK * 1024
    sent = sum(n * itemsize if c is None else quant.wire_bytes(n, c) for c in codecs)
    return sent / (2 * n * itemsize)


@dataclass(frozen=True, slots=True)
class LinkMeasure:
    """What the rule of [Note: automatic codecs] reads about one link, per micro-batch."""

    between_hosts: bool
    boundary_bytes: int
    """The activation that crosses it, at the exact dtype (its gradient is as large)."""
    link_bytes_per_s: float | None
    """The link's probed rate; None: not measured."""
    compute_s: tuple[float, float]
    """Seconds of compute of the upstream and the downstream stage."""
    compressed: bool = False
    """The plan compresses this link already (the same cut between the same hosts)."""


HOLD = 0.8
"""A compressed link goes back to exact only once its exact transfer takes less than this share
of the slower stage's compute (see [Note: automatic codecs])."""


def choose_auto(measure: LinkMeasure) -> tuple[Codecs, str]:
    """The codecs ``wire_dtype="auto"`` gives one link, and why (see [Note: automatic
    codecs]); pure, so the decision can be tested without a cluster."""
    if not measure.between_hosts:
        return (None, None), "auto: exact (one host)"
    rate = measure.link_bytes_per_s
    if rate is None or not rate > 0 or rate == float("inf"):
        return (None, None), "auto: exact (link not measured yet)"
    transfer = 2 * measure.boundary_bytes / rate
    slower = max(measure.compute_s)
    figures = (
        f"link {rate / 1e6:.3g} MB/s: {1e3 * transfer:.3g} ms per micro-batch both ways exact, "
        f"slower stage {1e3 * slower:.3g} ms"
    )
    if transfer > slower:
        return (
            AUTO_CODECS,
            f"auto: int8 activations, bfloat16 gradients (the bottleneck: {figures})",
        )
    if measure.compressed and transfer > HOLD * slower:
        return (
            AUTO_CODECS,
            f"auto: int8 activations, bfloat16 gradients (kept: within {1 - HOLD:.0%} of the "
            f"bottleneck: {figures})",
        )
    return (None, None), f"auto: exact (not the bottleneck: {figures})"


@dataclass(frozen=True, slots=True)
class Link:
    """The link from rank ``source`` to rank ``source + 1`` (mod the stages: the last rank
    sends back to rank 0 when the job has virtual stages)."""

    source: int
    between_hosts: bool
    codecs: Codecs
    reason: str = ""
    """Why it has those codecs, when the plan says (``wire_dtype="auto"``)."""

    @property
    def target(self) -> int:
        return self.source + 1

    def describe(self, num_stages: int) -> str:
        a, g = (c or "exact" for c in self.codecs)
        where = "between hosts" if self.between_hosts else "on one host"
        return (
            f"rank {self.source} -> {self.target % num_stages}: {where}, activations {a}, "
            f"gradients {g}" + (f" ({self.reason})" if self.reason else "")
        )


def links(config: JobConfig, pipeline: Sequence[PipelineStage]) -> list[Link]:
    """Each link of one pipeline (one replica's stages; each server once, its chunk 0), in
    rank order; with virtual stages, the last one goes from the last rank back to rank 0. A
    link whose upstream entry has a ``link_codec`` takes it; the others the host rule.

    Raises:
        InvalidArgumentError: a plan entry's ``link_codec`` is malformed.
    """
    servers = sorted((s for s in pipeline if s.chunk == 0), key=lambda s: s.rank)
    count = len(servers) if config.virtual_stages > 1 and len(servers) > 1 else len(servers) - 1
    result = []
    for rank in range(max(count, 0)):
        source = servers[rank]
        between = crosses_hosts(source.address, servers[(rank + 1) % len(servers)].address)
        if source.link_codec:
            codecs = fixed_codecs(config, source.link_codec)
            result.append(Link(rank, between, codecs, source.link_reason))
        elif config.wire_dtype == WIRE_AUTO:
            why = "auto: exact (one host)" if not between else "auto: exact until measured"
            result.append(Link(rank, between, codecs_for(config, between), why))
        else:
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
