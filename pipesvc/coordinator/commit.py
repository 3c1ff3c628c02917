"""The commit phase of a training step: every stage applies its pending run, or none is left
behind (see [Note: commit invariant]).

[Note: commit] A training step is a prepare phase (RunStep on every stage: forward and backward,
gradients pending) and a commit phase (each stage applies its optimizer step). If any stage
fails in prepare, every stage gets Abort and no weights change anywhere. Once every stage has
prepared the step and its batch is in the step log, the step is decided and counts as
committed: every stage reaches it, or recovery brings them all there before any later call (see
[Note: commit invariant] in commit.py).

[Note: commit invariant] A commit is all-or-none as seen by every later call: either every stage
of the plan reaches the step, or the job rebuilds them all to it before any later call (step,
forward, state read or save) touches them. The step's batch is in the write-ahead step log and
every stage holds it prepared before it is decided, so once decided the step counts as
committed. Its commit is usually carried by the next RunStep (see [Note: deferred commit] in
ledger.py); ``commit_all`` sends it explicitly (a flush), or settles it after a run that carried
it failed (``after_failed_run``: some stages may hold it applied already):

1. Commit goes to every stage under the same health watchdog as the run phase (see [Note:
   detection]), so a killed or stopped stage is found in about ``health_failures`` health
   intervals, not after the control deadline.
2. If some stage's Commit failed for any other reason (even a "final" one, such as
   RESOURCE_EXHAUSTED from a concurrency cap, which is no fault of the caller's batch once the run
   phase succeeded), ``commit_all`` asks every stage where it is and commits again on each one
   that still holds the pending run, a few times. A settle after a failed run starts here.
3. If that cannot bring every stage to the step (a stage lost, the run gone, or the retries
   failing), ``CommitIncompleteError`` tells the job to rebuild: it records the step as the
   replay target, so recovery restores the newest checkpoint and replays the step log up to and
   including this step, and every call starts by finishing such a rebuild.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipesvc.coordinator.job_counters import PendingCommit
from pipesvc.coordinator.stage_calls import Deadlines, StageLostError, call_all, where
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.core.plan import PipelineStage
from pipesvc.errors import PipesvcError, StageUnavailableError
from pipesvc.v1 import stage_pb2

if TYPE_CHECKING:  # stage_group imports this module's commit_all
    from pipesvc.coordinator.stage_group import StageGroup

logger = logging.getLogger(__name__)

COMMIT_RETRIES = 3
"""Rounds of committing again on the stages that still hold the pending run."""
RETRY_BACKOFF_S = 0.2
"""Pause before the first retry round; doubles each round (a concurrency cap frees up)."""


class CommitIncompleteError(StageUnavailableError):
    """Some stage did not reach the step: the job must rebuild its stages to it."""


def commit_all(
    registry: StageRegistry,
    plan: Sequence[PipelineStage],
    request: stage_pb2.CommitRequest,
    *,
    step: int,
    deadlines: Deadlines,
    after_failed_run: bool = False,
) -> None:
    """Commits ``request.run_id`` (training step ``step``) on every stage of ``plan``; returns
    once every stage reports the step (see [Note: commit invariant]).

    ``after_failed_run``: the commit was carried by a run that failed and has been aborted, so
    some stages may have applied it already; skip the first blind round and commit only where
    it is still pending.

    Raises:
        StageLostError: a stage stopped answering health checks (it is to be replaced).
        CommitIncompleteError: some stage could not be brought to the step.
    """
    what = f"commit of step {step}"

    def commit_on(stages: Sequence[PipelineStage]) -> None:
        call_all(
            registry,
            stages,
            lambda stub, s: (stub.Commit, request),
            deadlines.control_s,
            deadlines=deadlines,
            what=what,
        )

    last: PipesvcError | None = None
    if not after_failed_run:
        try:
            commit_on(plan)
            return
        except StageLostError:
            raise
        except PipesvcError as exc:
            last = exc
        logger.warning("%s failed: %s; committing again where it is pending", what, last)
    for round_index in range(COMMIT_RETRIES):
        if last is not None:
            # The pause also lets Commit calls still in flight (call_all returns on the first
            # error) land before the stages are asked where they are.
            time.sleep(RETRY_BACKOFF_S * 2**round_index)
        laggards = _laggards(registry, plan, request, step=step, deadlines=deadlines)
        if not laggards:
            logger.warning("%s completed on every stage", what)
            return
        try:
            commit_on(laggards)
        except StageLostError:
            raise
        except PipesvcError as exc:
            last = exc
    if not _laggards(registry, plan, request, step=step, deadlines=deadlines):
        return
    raise CommitIncompleteError(
        f"{what} did not reach every stage after {COMMIT_RETRIES} retries; last error: {last}"
    ) from last


def _laggards(
    registry: StageRegistry,
    plan: Sequence[PipelineStage],
    request: stage_pb2.CommitRequest,
    *,
    step: int,
    deadlines: Deadlines,
) -> list[PipelineStage]:
    """The stages still holding run ``request.run_id`` at step ``step - 1``.

    Raises:
        StageLostError: a stage stopped answering health checks.
        CommitIncompleteError: a stage is neither at the step nor holding the run (it cannot
            get there by a commit), or could not say where it is.
    """
    try:
        infos = call_all(
            registry,
            plan,
            lambda stub, s: (stub.Info, stage_pb2.InfoRequest()),
            deadlines.control_s,
            deadlines=deadlines,
            what="commit check",
        )
    except StageLostError:
        raise
    except PipesvcError as exc:
        raise CommitIncompleteError(f"could not check the commit of step {step}: {exc}") from exc
    laggards = []
    for stage, info in zip(plan, infos, strict=True):
        same_job = info.job_id == request.job_id and info.plan_epoch == request.plan_epoch
        if same_job and info.step == step and not info.pending_run_id:
            continue
        if same_job and info.step == step - 1 and info.pending_run_id == request.run_id:
            laggards.append(stage)
            continue
        raise CommitIncompleteError(
            f"{where(stage)} is at step {info.step} of job {info.job_id!r} epoch "
            f"{info.plan_epoch} with pending run {info.pending_run_id}; expected step {step}, "
            f"or step {step - 1} with run {request.run_id} pending"
        )
    return laggards


class GroupCommitter:
    """Sends a job's pending commit to every stage of its plan as it is now (the ledger's
    ``Committer``): the one place an explicit Commit of a decided step goes out."""

    def __init__(self, group: StageGroup) -> None:
        self._group = group

    def commit(self, pending: PendingCommit, *, after_failed_run: bool) -> None:
        """``pending`` committed on the group's stages over their Control streams, checked
        and retried as ``commit_all`` does (``StageGroup.commit``).

        Raises:
            StageLostError, CommitIncompleteError: as ``commit_all``.
        """
        group = self._group
        group.commit(
            pending.request(group.job_id, group.epoch),
            step=pending.step,
            after_failed_run=after_failed_run,
        )
