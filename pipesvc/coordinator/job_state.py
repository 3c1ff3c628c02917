"""A job's counters and flags: where its training is, and how they map to its database row."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipesvc.coordinator.state_db import REMEMBERED_RESULTS, JobRecord, StepResult
from pipesvc.core.config import JobConfig, config_to_dict
from pipesvc.core.plan import PipelineStage, plan_to_dicts
from pipesvc.v1 import stage_pb2


@dataclass(frozen=True, kw_only=True)
class PendingCommit:
    """A decided step whose commit the stages have not applied yet (see [Note: deferred
    commit] in job.py): the next run carries it, or ``Recovery.flush`` sends it."""

    step: int
    """The step it commits (``JobState.step`` counts it already)."""
    run_id: int
    """The prepared training run every stage holds."""
    grad_scale: float | None
    """The global clipping scale, or None when the job does not clip."""
    snapshot: bool = False
    """The step is due a periodic checkpoint: the run that carries the commit asks every
    stage for a snapshot (see [Note: snapshot checkpoint] in stage/engine.py)."""

    def request(self, job_id: str, epoch: int) -> stage_pb2.CommitRequest:
        """The explicit Commit that flushes it."""
        request = stage_pb2.CommitRequest(job_id=job_id, plan_epoch=epoch, run_id=self.run_id)
        if self.grad_scale is not None:
            request.grad_scale = self.grad_scale
        return request

    def carried(self) -> stage_pb2.CarriedCommit:
        """The same commit, carried by the next RunStep."""
        carried = stage_pb2.CarriedCommit(run_id=self.run_id, snapshot=self.snapshot)
        if self.grad_scale is not None:
            carried.grad_scale = self.grad_scale
        return carried


@dataclass(kw_only=True)
class JobState:
    """The mutable state of one job apart from its stages (which ``StageGroup`` holds)."""

    step: int = 0
    """Steps committed on the stages as they are now (behind ``replay_target`` mid-replay),
    counting a decided step whose commit is ``pending``."""
    pending: PendingCommit | None = None
    """The decided step every stage holds prepared, not yet committed (it is step ``step``)."""
    run_id: int = 0
    """Highest run id used."""
    checkpoint_step: int = -1
    """Step of the newest checkpoint, or -1 when the initial weights are the seed's."""
    replay_target: int | None = None
    """While set, the stages must be rebuilt to this step before any other call (a commit that
    did not reach every stage, or a recovery that gave up mid-replay)."""
    closed: bool = False
    recoveries: int = 0
    """Recoveries from lost stages so far (not durable)."""
    gradients_valid: bool = True
    """False after an aborted training run: stages that began it zeroed the last committed
    step's gradients in place, others kept them; none are reported until a commit."""
    results: OrderedDict[str, StepResult] = field(default_factory=OrderedDict)
    """The newest ``REMEMBERED_RESULTS`` training steps' results by request id, oldest first
    (see [Note: step request ids] in job.py)."""
    unsaved: list[StepResult] = field(default_factory=list)
    """Those of ``results`` not yet in the database (the next ``to_record`` carries them)."""

    def remember(self, result: StepResult) -> None:
        """Keeps a decided step's result under its request id (until written, unsaved)."""
        self.results[result.request_id] = result
        self.unsaved.append(result)
        while len(self.results) > REMEMBERED_RESULTS:
            self.results.popitem(last=False)

    def saved(self, results: Sequence[StepResult]) -> None:
        """``results`` are in the database now."""
        done = {id(r) for r in results}
        self.unsaved = [r for r in self.unsaved if id(r) not in done]

    @property
    def committed_step(self) -> int:
        """Committed steps: mid-replay, the replay's target, not where replay is."""
        return max(self.step, self.replay_target or 0)

    def to_record(
        self,
        *,
        job_id: str,
        config: JobConfig,
        layers: Sequence[stage_pb2.LayerDescription],
        plan: Sequence[PipelineStage],
        epoch: int,
    ) -> JobRecord:
        """The job's database row, with the parts that are not state given."""
        return JobRecord(
            job_id=job_id,
            spec=config_to_dict(config),
            plan=plan_to_dicts(list(plan)),
            layers=stage_pb2.DescribeResponse(layers=layers).SerializeToString(),
            epoch=epoch,
            step=self.committed_step,
            run_id=self.run_id,
            checkpoint_step=self.checkpoint_step,
            closed=self.closed,
            results=list(self.unsaved),
        )

    @classmethod
    def from_record(cls, record: JobRecord) -> JobState:
        """The state saved in ``record`` (a replay it needed is found again by reconciling)."""
        return cls(
            step=record.step,
            run_id=record.run_id,
            checkpoint_step=record.checkpoint_step,
            closed=record.closed,
            results=OrderedDict((r.request_id, r) for r in record.results),
        )
