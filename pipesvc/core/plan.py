"""The plan: which stage server holds which half-open layer range, at which rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import common_pb2


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineStage:
    """One stage of a plan: layers ``[start_layer, end_layer)`` on the server at ``address``."""

    start_layer: int
    """First layer held (inclusive)."""
    end_layer: int
    """One past the last layer held."""
    rank: int
    """Position in the pipeline; 0 holds the first layers."""
    address: str = ""
    """host:port of the stage server."""
    replica: int = 0
    """Which replica of the pipeline this stage belongs to (see [Note: replicas]); 0 without."""
    chunk: int = 0
    """Which of the server's layer ranges this is (see [Note: virtual stages]); 0 when it
    holds one. A plan lists every range; the server's first (chunk 0) stands for it."""
    link_codec: str = ""
    """The codecs of the link from this stage to the next rank when the plan fixes them
    (``wire_dtype="auto"``, see [Note: automatic codecs] in ``pipesvc.core.link_codecs``):
    ``"exact"`` or a ``wire_dtype`` text; empty: the host rule decides."""
    link_reason: str = ""
    """Why the link has those codecs (for ``job.links`` and the live page); empty without."""

    @property
    def num_layers(self) -> int:
        """How many layers this stage holds."""
        return self.end_layer - self.start_layer

    # [Note: plan entry conversions] The wire message (common_pb2.PlanStage) and the JSON form
    # (manifests, the state database) are written here and nowhere else, so a new field is
    # added in one place.

    def to_proto(self) -> common_pb2.PlanStage:
        """The wire form of this stage."""
        return common_pb2.PlanStage(
            start_layer=self.start_layer,
            end_layer=self.end_layer,
            rank=self.rank,
            address=self.address,
            replica=self.replica,
            chunk=self.chunk,
            link_codec=self.link_codec,
            link_reason=self.link_reason,
        )

    @classmethod
    def from_proto(cls, message: common_pb2.PlanStage) -> PipelineStage:
        """A stage from its wire form (unchecked; see :func:`check_plan`)."""
        return cls(
            start_layer=message.start_layer,
            end_layer=message.end_layer,
            rank=message.rank,
            address=message.address,
            replica=message.replica,
            chunk=message.chunk,
            link_codec=message.link_codec,
            link_reason=message.link_reason,
        )

    def to_dict(self) -> dict[str, Any]:
        """This stage as a JSON-ready dict (the link fields only when set, so a plan without
        them reads the same as before they existed)."""
        values: dict[str, Any] = {
            "start_layer": self.start_layer,
            "end_layer": self.end_layer,
            "rank": self.rank,
            "address": self.address,
            "replica": self.replica,
            "chunk": self.chunk,
        }
        if self.link_codec:
            values["link_codec"] = self.link_codec
        if self.link_reason:
            values["link_reason"] = self.link_reason
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PipelineStage:
        """A stage from :meth:`to_dict`'s form.

        Raises:
            InvalidArgumentError: a missing or unknown key, or a value of the wrong type.
        """
        names = {f.name for f in fields(cls)}
        if not isinstance(values, Mapping):
            raise InvalidArgumentError(f"plan stage {values!r} must be a mapping")
        unknown = sorted(set(values) - names)
        if unknown:
            raise InvalidArgumentError(
                f"plan stage {dict(values)!r}: unknown fields {unknown}; expected {sorted(names)}"
            )
        try:
            stage = cls(**values)
        except TypeError as exc:
            raise InvalidArgumentError(f"plan stage {dict(values)!r}: {exc}") from exc
        for name in ("start_layer", "end_layer", "rank", "replica", "chunk"):
            value = getattr(stage, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"plan stage {name} ({value!r}) must be an int")
        for name in ("address", "link_codec", "link_reason"):
            value = getattr(stage, name)
            if not isinstance(value, str):
                raise InvalidArgumentError(f"plan stage {name} ({value!r}) must be a string")
        return stage


def plan_to_dicts(plan: Sequence[PipelineStage]) -> list[dict[str, Any]]:
    """A plan as JSON-ready dicts (for manifests and the state database)."""
    return [stage.to_dict() for stage in plan]


def plan_from_dicts(values: Sequence[Mapping[str, Any]]) -> list[PipelineStage]:
    """A plan from :func:`plan_to_dicts`'s form (unchecked; see :func:`check_plan`).

    Raises:
        InvalidArgumentError: an entry is malformed.
    """
    return [PipelineStage.from_dict(entry) for entry in values]


def replicas_of(plan: Sequence[PipelineStage]) -> list[list[PipelineStage]]:
    """The plan's pipelines, one per replica in replica order, each in rank order (a plan is
    listed by replica, then rank)."""
    found: dict[int, list[PipelineStage]] = {}
    for stage in plan:
        found.setdefault(stage.replica, []).append(stage)
    return [found[r] for r in sorted(found)]


def check_plan(plan: Sequence[PipelineStage], num_layers: int) -> None:
    """Checks that every replica of ``plan`` (listed in replica order, 0..R-1) covers
    ``[0, num_layers)`` exactly once with ranks 0..n-1 in order, with the same cuts, on
    distinct stage servers.

    Raises:
        InvalidArgumentError: a gap, overlap, empty stage, rank or replica out of order,
            replicas cut differently, or a server twice.
    """
    if not plan:
        _check_pipeline(plan, num_layers)
        return
    pipelines = replicas_of(plan)
    if [s.replica for s in plan] != [s.replica for p in pipelines for s in p] or [
        p[0].replica for p in pipelines
    ] != list(range(len(pipelines))):
        raise InvalidArgumentError(
            f"plan replicas {[s.replica for s in plan]} must be listed in order from 0"
        )
    for pipeline in pipelines:
        _check_pipeline(pipeline, num_layers)
    cuts = [[(s.start_layer, s.end_layer) for s in p] for p in pipelines]
    if any(c != cuts[0] for c in cuts):
        raise InvalidArgumentError(f"replicas are cut differently: {cuts}")
    addresses = [s.address for s in servers_of(plan)]
    if len(pipelines) > 1 and len(set(addresses)) != len(addresses):
        raise InvalidArgumentError(f"a stage server appears twice in the plan: {addresses}")


def servers_of(plan: Sequence[PipelineStage]) -> list[PipelineStage]:
    """One entry per stage server of the plan (its chunk 0), in plan order."""
    return [s for s in plan if s.chunk == 0]


def _check_pipeline(plan: Sequence[PipelineStage], num_layers: int) -> None:
    servers = max(1, len(servers_of(plan)))
    expected_start = 0
    for position, stage in enumerate(plan):
        if stage.rank != position % servers or stage.chunk != position // servers:
            raise InvalidArgumentError(
                f"plan stage {position} has rank {stage.rank} and chunk {stage.chunk}; "
                f"expected rank {position % servers} and chunk {position // servers}"
            )
        if stage.address != plan[stage.rank].address:
            raise InvalidArgumentError(
                f"plan stage {position} (rank {stage.rank}, chunk {stage.chunk}) is on "
                f"{stage.address!r}, its rank's chunk 0 on {plan[stage.rank].address!r}"
            )
        if stage.start_layer != expected_start or stage.end_layer <= stage.start_layer:
            raise InvalidArgumentError(
                f"plan stage {position} holds [{stage.start_layer}, {stage.end_layer}); "
                f"expected a non-empty range starting at {expected_start}"
            )
        expected_start = stage.end_layer
    if expected_start != num_layers:
        raise InvalidArgumentError(f"plan covers {expected_start} layers of {num_layers}")
