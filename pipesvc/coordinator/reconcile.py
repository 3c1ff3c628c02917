"""Reconciling a job with its stages after a coordinator restart (see [Note: decision record]
in docs/architecture.md): the stages are adopted as they are when they agree with the job's
row, with a decided step committed where it is still prepared; otherwise the job is rebuilt.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.stage_calls import call_stage
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.errors import PipesvcError
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)


def reconcile(group: StageGroup, ledger: Ledger) -> set[str] | None:
    """After a coordinator restart: adopts the stages as they are (None), or returns the stages
    to rebuild the job without (the ones that did not come back; empty: the same plan)."""
    registry = group.registry
    addresses = group.addresses
    known = _wait_for_stages(group)
    consistent = set(addresses) <= known
    infos: list[Any] = []
    if consistent:
        try:
            infos = group.call_all(lambda stub: stub.Info, lambda s: stage_pb2.InfoRequest(), 5.0)
        except PipesvcError:
            consistent = False
    # The row's step is decided (see [Note: deferred commit] in ledger.py); a stage one step
    # behind holds it prepared, with its commit not yet flushed, or did not get there.
    consistent = consistent and all(
        i.job_id == group.job_id
        and i.plan_epoch == group.epoch
        and (i.step == ledger.step or (i.step == ledger.step - 1 and i.pending_run_id))
        for i in infos
    )
    behind = (
        [(s, i) for s, i in zip(group.servers, infos, strict=True) if i.step < ledger.step]
        if consistent
        else []
    )
    if behind and group.config.clip_grad_norm is not None:
        consistent = False  # its gradient scale was not saved: replay the step instead
    ledger.adopt_runs([i.last_run_id for i in infos])
    _abort_interrupted_run(group, ledger, infos)
    if consistent:
        ahead = max((i.pending_run_id for i in infos if i.step == ledger.step), default=0)
        if ahead:  # a run of the next step, never decided
            group.abort(ahead)
        try:
            for stage, info in behind:
                request = stage_pb2.CommitRequest(
                    job_id=group.job_id, plan_epoch=group.epoch, run_id=info.pending_run_id
                )
                call_stage(
                    registry,
                    stage,
                    lambda stub: stub.Commit,
                    request,
                    group.deadlines.control_s,
                )
        except PipesvcError as exc:
            logger.warning("job %s: committing the decided step failed: %s", group.job_id, exc)
            consistent = False
    if consistent:
        _adopt(group)
        logger.info(
            "job %s: resumed with its stages as they were (step %d)", group.job_id, ledger.step
        )
        return None
    logger.warning("job %s: stages disagree with the saved state; rebuilding", group.job_id)
    registry.claim([a for a in addresses if a in known], group.job_id)
    return set(addresses) - known


def _wait_for_stages(group: StageGroup) -> set[str]:
    """The addresses of the live registered stages, once every stage of the plan is among
    them or the reconcile deadline has passed (stages re-register after the restart)."""
    addresses = set(group.addresses)
    deadline = time.monotonic() + group.deadlines.reconcile_s
    known: set[str] = set()
    while time.monotonic() < deadline:
        known = {r.address for r in group.registry.all() if r.alive}
        if addresses <= known:
            break
        time.sleep(0.2)
    return known


def _abort_interrupted_run(group: StageGroup, ledger: Ledger, infos: list[Any]) -> None:
    """Aborts everywhere a run that the stages' ``infos`` show reached only some of them.

    A coordinator killed while it sent a run leaves it on the stages it reached, where it may
    still wait for a neighbour the run never reached (its whole receive deadline, with the
    stage's run lock held, so every later call would wait behind it). The newest run any stage
    started is not decided unless it is a behind stage's pending one (decided runs are
    committed by ``reconcile``), and stages that disagree on their newest run show that it did
    not reach them all: it is aborted everywhere first, which wakes its waits. (A run that
    reached every stage finished there: prepared, ``reconcile`` aborts it as before.)
    """
    decided = {i.pending_run_id for i in infos if i.pending_run_id and i.step < ledger.step}
    started = {i.last_run_id for i in infos}
    newest = max(started, default=0)
    ours = all(i.job_id == group.job_id for i in infos)
    if len(started) > 1 and newest not in decided and ours:
        group.abort(newest)


def _adopt(group: StageGroup) -> None:
    """Claims the job's stages as they are and records each one's place in the plan."""
    group.registry.claim(group.addresses, group.job_id)
    for stage in group.servers:
        group.registry.place(
            stage.address,
            rank=stage.rank,
            start_layer=stage.start_layer,
            end_layer=stage.end_layer,
        )
