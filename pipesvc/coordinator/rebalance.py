"""Measuring a job's stages and moving its layers between steps (see [Note: throughput plan]
in ``pipesvc.core.planning.throughput``).

[Note: replan] ``Replanner.apply`` moves a running job to a new plan between two steps: it
commits the decided step everywhere, writes a checkpoint of every stage's weights and
optimizer state, gives every stage of the new plan its range under a new plan epoch, and loads
the checkpoint into them; stages that leave the plan drop the job and go back to the free
pool. Nothing is replayed: the checkpoint is at the last step, so the next step starts from
exactly the state the old plan had, and training goes on with identical numbers.

[Note: measured speed] A layer's cost is the same wherever it runs; a stage's speed is what
it gets done per second where it runs, other work on its host included. The stages count each
layer's forward operations once (``torch.utils.flop_counter``) and time every training
micro-batch, so a stage's speed is its layers' operations over their forward time, and a
layer's cost is its measured time (forward and backward) at its stage's speed: the layers
without counted operations (an embedding lookup) keep the cost their time shows. A stage with
no measured speed (a free one, or one whose layers count no operations) gets its calibration
product's rate, scaled by the median ratio of measured to calibrated speed over the job's
stages. Speeds measured while the job trains include what training itself does to the host
(stages sharing cores); a calibration on its own does not.

A job created with ``partition="throughput"`` starts balanced by parameters, because nothing
is measured yet. After ``PROBE_STEPS`` training steps (the probe: real steps, so no work is
wasted) it measures its stages and moves to the throughput plan if that is predicted enough
faster; with ``rebalance`` on, it also measures every ``REBALANCE_EVERY`` steps. When to
measure and whether to move is ``pipesvc.core.settle``'s (see [Note: settling]): a plan
settles, and the job measures again only when its step time or its stages change.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from concurrent import futures

from pipesvc.coordinator import planner
from pipesvc.coordinator.checkpointer import Checkpointer
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.recovery import Recovery
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.coordinator.stage_registry import StageRecord
from pipesvc.core.config import JobConfig
from pipesvc.core.link_codecs import (
    links,
    wire_fraction,
)
from pipesvc.core.plan import PipelineStage
from pipesvc.core.planning import placement, throughput
from pipesvc.core.planning.measured import (
    Decision,
    Measurements,
    codecs_of,
    decide_links,
    decides_links,
    exact_itemsize,
    link_hosts,
    measurements,
    operations,
    probe_pairs,
    report,
    with_codecs,
)
from pipesvc.core.settle import REBALANCE_EVERY, Policy, Settler, Verdict
from pipesvc.errors import PipesvcError, PlanError
from pipesvc.v1 import stage_pb2
from pipesvc.wire.transport import call

logger = logging.getLogger(__name__)

CALIBRATE_S = 0.5
"""Seconds each stage times its calibration product (all stages at once, so stages sharing a
host's cores measure the share they get while they all work)."""
LINK_RATE_ENV = "PIPESVC_TEST_LINK_BYTES_PER_S"
"""Tests only: when the coordinator's environment sets it, every link it probed is taken to
have measured this many bytes per second instead (a slow link on demand on one machine, so the
choice of ``wire_dtype="auto"`` is deterministic; the probes still run)."""
PROBE_TIMEOUT_S = 120.0
"""Deadline of one stage's link probe beyond the control deadline (its sends have 30 s each)."""
AUTO_ROUNDS = 3
"""Plans the ``auto`` search tries at most (see ``Replanner.choose``)."""


class Replanner:
    """Measures the stages of one job and moves its layers (called with the job's lock held)."""

    def __init__(
        self, *, group: StageGroup, ledger: Ledger, checkpoints: Checkpointer, recovery: Recovery
    ) -> None:
        self._group = group
        self._ledger = ledger
        self._checkpoints = checkpoints
        self._recovery = recovery
        self.settler = Settler(Policy())
        """When this job measures and whether it moves by itself (see [Note: settling])."""

    def measure(self, *, probe_again: bool = False) -> Measurements:
        """Profiles the job's stages; when there are free stages, or a stage without a
        measured speed, calibrates them all at once too (see [Note: measured speed]). Links
        between hosts are probed unless probed lately, or always with ``probe_again`` (see
        [Note: link rate cache]).

        Raises:
            FailedPreconditionError: a layer has no timings yet (no training step on this
                plan).
            PipesvcError: a stage did not answer.
        """
        group = self._group
        records = {r.address: r for r in group.registry.all()}
        stages = [records[s.address] for s in group.plan]
        free = group.registry.free(group.config.model)
        profiles = [] if free else self._profile(stages, 0.0)
        if free or any(not operations(p) for p in profiles):
            stages += free
            profiles = self._profile(stages, CALIBRATE_S)
        probed = self._probe_links(probe_pairs(group.plan, stages), probe_again=probe_again)
        forced = os.environ.get(LINK_RATE_ENV)
        if forced:
            probed = {pair: float(forced) for pair in probed}
        measured = measurements(group.plan, len(group.layers), stages, profiles, probed)
        if decides_links(group.config):  # the boundary bytes are exact; the links may not be
            rates = with_codecs(group.config, measured, group.plan, links(group.config, group.plan))
            ranges = [(s.start_layer, s.end_layer) for s in group.plan]
            current_s = throughput.predict(measured.costs, rates, ranges)
            measured = dataclasses.replace(measured, current_s=current_s)
        return measured

    def _profile(
        self, stages: list[StageRecord], calibrate_s: float
    ) -> list[stage_pb2.StageProfile]:
        """Every stage's profile at once (the job's for the first ``len(plan)``)."""
        group = self._group
        timeout_s = group.deadlines.control_s + calibrate_s

        def profile(index: int) -> stage_pb2.StageProfile:
            record = stages[index]
            job_id = group.job_id if index < len(group.plan) else ""
            request = stage_pb2.ProfileRequest(job_id=job_id, calibrate_s=calibrate_s)
            stub = group.registry.stub(record.address)
            return call(stub.Profile, request, timeout_s=timeout_s, where=f"stage {record.address}")

        with futures.ThreadPoolExecutor(max_workers=len(stages)) as pool:
            return list(pool.map(profile, range(len(stages))))

    def _probe_links(
        self, pairs: list[tuple[str, str]], *, probe_again: bool = False
    ) -> dict[frozenset[str], float]:
        """The rate of each pair of hosts, probed from the first stage of a pair to the second
        (see [Note: link probe] in ``pipesvc.stage.net.probe``), one pair at a time, unless the
        coordinator probed that pair of hosts lately (see [Note: link rate cache]); a pair
        whose probe failed (a stage too old to probe, one gone) is left out: its links stay
        unmeasured, so ``auto`` keeps them exact."""
        group = self._group
        cache = group.registry.link_rates
        rates: dict[frozenset[str], float] = {}
        for source, target in pairs:
            pair = link_hosts(source, target)
            known = None if probe_again else cache.fresh(pair)
            if known is not None:
                rates[pair] = known
                continue
            stub = group.registry.stub(source)
            try:
                answer = call(
                    stub.ProbeLink,
                    stage_pb2.ProbeLinkRequest(target=target),
                    timeout_s=group.deadlines.control_s + PROBE_TIMEOUT_S,
                    where=f"stage {source}",
                )
            except PipesvcError as exc:
                logger.warning(
                    "job %s: no link rate from %s to %s: %s", group.job_id, source, target, exc
                )
                continue
            if answer.bytes_per_s > 0 and math.isfinite(answer.bytes_per_s):
                rates[pair] = answer.bytes_per_s
                cache.record(pair, answer.bytes_per_s)
                logger.info(
                    "job %s: link %s -> %s: %.3g MB/s (%d bytes in %.3f s)",
                    group.job_id,
                    source,
                    target,
                    answer.bytes_per_s / 1e6,
                    answer.bytes,
                    answer.seconds,
                )
        return rates

    def choose(self, partition: str, *, probe_again: bool = False) -> Decision:
        """The plan ``partition`` gives (``throughput``: from a new measurement, and only if
        predicted faster than the current plan); nothing moves. Whether a job moves by itself
        is the settler's to say (see [Note: settling]). ``probe_again``: see ``measure``.

        Raises:
            FailedPreconditionError: ``throughput`` before any training step on this plan.
            ResourceExhaustedError: no plan of the method fits the stages' memory.
            PipesvcError: a stage did not answer the measurement.
        """
        group = self._group
        config = dataclasses.replace(group.config, partition=partition)
        current = list(group.plan)
        current_s: list[float] = []
        predicted_s: list[float] = []
        if partition == "throughput":
            measured = self.measure(probe_again=probe_again)
            if decides_links(config):
                plan, predicted_s = self._auto_plan(config, measured)
            else:
                plan, predicted_s = placement.throughput_plan(
                    config, group.layers, measured.costs, measured.stages, measured.rates
                )
            current_s = measured.current_s
            logger.info(
                "job %s: measured\n%s", group.job_id, report(measured, current, plan, predicted_s)
            )
            if max(predicted_s) >= max(current_s):  # not faster
                plan, predicted_s = current, current_s
                if decides_links(config):
                    # The same ranges, their links decided again by this measurement: a link
                    # compressed while it was slow goes back to exact once it is fast (there
                    # the current plan, compressed, predicts as fast as the exact one, so the
                    # plan found is not faster). Only a change of codecs is a move (a reason's
                    # figures change with every measurement; a move costs a checkpoint).
                    decided = decide_links(config, current, measured)
                    if codecs_of(config, decided) != codecs_of(config, current):
                        plan = decided
                        predicted_s = throughput.predict(
                            measured.costs,
                            with_codecs(config, measured, plan, links(config, plan)),
                            [(s.start_layer, s.end_layer) for s in plan],
                        )
        else:
            records = {r.address: r for r in group.registry.all()}
            plan = placement.plan_on(config, group.layers, [records[s.address] for s in current])
        return Decision(
            plan=plan,
            moved=plan != current,
            current_s=current_s,
            predicted_s=predicted_s,
            partition=partition,
            based_on=current,
        )

    def _auto_plan(
        self, config: JobConfig, measured: Measurements
    ) -> tuple[list[PipelineStage], list[float]]:
        """The throughput plan of a ``wire_dtype="auto"`` job, each link's codecs fixed in it
        (see [Note: automatic codecs] in ``pipesvc.core.link_codecs``), and each rank's
        predicted seconds per micro-batch with those codecs.

        The codecs depend on the ranges and the ranges on the links' bytes, so the search
        plans with every link exact, decides each link of that plan, plans again with the
        decided stages' links counted in their codecs, and so on until the codecs stop
        changing (at most ``AUTO_ROUNDS`` plans); the fastest predicted plan wins.
        """
        layers = self._group.layers
        index = {record.address: i for i, record in enumerate(measured.stages)}
        itemsize = exact_itemsize(config)
        fractions: dict[int, float] = {}
        best: tuple[list[PipelineStage], list[float]] | None = None
        for _ in range(AUTO_ROUNDS):
            rates = [
                dataclasses.replace(rate, wire_fraction=fractions.get(i, 1.0))
                for i, rate in enumerate(measured.rates)
            ]
            plan, _ = placement.throughput_plan(
                config, layers, measured.costs, measured.stages, rates
            )
            plan = decide_links(config, plan, measured)
            chosen = links(config, plan)
            predicted = throughput.predict(
                measured.costs,
                with_codecs(config, measured, plan, chosen),
                [(s.start_layer, s.end_layer) for s in plan],
            )
            if best is None or max(predicted) < max(best[1]):
                best = (plan, predicted)
            wanted = {
                index[plan[link.source].address]: wire_fraction(link.codecs, itemsize)
                for link in chosen
            }
            if all(fractions.get(i, 1.0) == f for i, f in wanted.items()):
                break
            fractions.update(wanted)
        assert best is not None
        return best

    def apply(self, decision: Decision, *, keep_partition: bool = False) -> None:
        """Moves the job to ``decision``'s plan (see [Note: replan]) and, unless
        ``keep_partition`` (a rebalance), takes its partition method; nothing moves if the job
        is on that plan already, or no longer on the plan the decision was made on (a recovery
        came between).

        Raises:
            PlanError: a chosen free stage was taken by another job meanwhile.
            PipesvcError: a stage failed while the layers moved: the job goes back to its old
                plan, rebuilt from the checkpoint written first, on its next call.
        """
        group = self._group
        if group.plan != decision.based_on:
            logger.warning(
                "job %s: the plan changed since it was measured; not moving", group.job_id
            )
            return
        if not keep_partition:
            group.config = dataclasses.replace(group.config, partition=decision.partition)
        if decision.plan != group.plan:
            self._move(decision.plan)
        self._ledger.persist()

    def rebalance_due(self, took: float) -> tuple[Decision, Verdict] | None:
        """After a committed step that took ``took`` seconds, for a ``throughput`` or a
        ``rebalance`` job: measures when the settler says so (see [Note: settling] in
        core/settle.py) and returns the throughput plan with the settler's verdict on it; None
        when nothing is due. The job moves (``apply``) if the verdict says so.

        Raises:
            PipesvcError: the measurement failed.
        """
        group = self._group
        config = group.config
        if config.partition != "throughput" and not config.rebalance:
            return None
        self.settler.policy = Policy(
            probe=config.partition == "throughput",
            every=REBALANCE_EVERY if config.rebalance else None,
        )
        members = [s.address for s in group.plan] + [
            r.address for r in group.registry.free(config.model)
        ]
        if self.settler.step(group.epoch, took, members) is None:
            return None
        decision = self.choose("throughput")
        return decision, self.settler.decide(max(decision.current_s), max(decision.predicted_s))

    def _move(self, plan: list[PipelineStage]) -> None:
        group, registry = self._group, self._group.registry
        old = list(group.plan)
        self._checkpoints.checkpoint()  # commits the decided step first
        kept = {s.address for s in plan}
        joining = [s for s in plan if s.address not in {o.address for o in old}]
        if joining and not registry.claim([s.address for s in joining], group.job_id):
            raise PlanError("free stages were taken by another job while replanning; try again")
        logger.warning(
            "job %s: moving to a new plan at step %d: %s",
            group.job_id,
            self._ledger.step,
            ", ".join(f"[{s.start_layer}, {s.end_layer}) on {s.address}" for s in plan),
        )
        planner.place(registry, plan)
        group.plan = plan
        try:
            self._recovery.rebuild(set())
        except BaseException:
            # Back to the old plan: its stages still hold the job; the next call rebuilds them
            # from the checkpoint (the replay target is set).
            group.plan = old
            planner.place(registry, old)
            registry.unclaim([s.address for s in joining])
            for stage in joining:
                group.release(stage)
            raise
        leaving = [s for s in old if s.address not in kept]
        for stage in leaving:
            group.release(stage)
        registry.unclaim([s.address for s in leaving])
