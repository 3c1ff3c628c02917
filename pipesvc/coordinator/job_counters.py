"""A job's counters apart from its step state, and the pending commit of a decided step (no
gRPC here; the step state and the row it maps to are ``pipesvc.coordinator.ledger``'s)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipesvc.coordinator.database import REMEMBERED_RESULTS, JobRecord, StepResult
from pipesvc.v1 import stage_pb2


@dataclass(frozen=True, kw_only=True)
class PendingCommit:
    """A decided step whose commit the stages have not applied yet (see [Note: deferred
    commit] in job.py): the next run carries it, or ``Ledger.flush`` sends it."""

    step: int
    """The step it commits (``Ledger.step`` counts it already)."""
    run_id: int
    """The prepared training run every stage holds."""
    grad_scale: float | None
    """The global clipping scale, or None when the job does not clip."""
    snapshot: bool = False
    """The step is due a periodic checkpoint: the run that carries the commit asks every
    stage for a snapshot (see [Note: snapshot checkpoint] in stage/compute/engine.py)."""

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
    """A job's counters apart from its step state (which ``Ledger`` owns) and its stages
    (which ``StageGroup`` holds)."""

    closed: bool = False
    recoveries: int = 0
    """Recoveries from lost stages so far (not durable)."""
    results: OrderedDict[str, StepResult] = field(default_factory=OrderedDict)
    """The newest ``REMEMBERED_RESULTS`` training steps' results by request id, oldest first
    (see [Note: step request ids] in step_request.py)."""
    unsaved: list[StepResult] = field(default_factory=list)
    """Those of ``results`` not yet in the database (the ledger's next row carries them)."""

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

    @classmethod
    def from_record(cls, record: JobRecord) -> JobState:
        """The counters saved in ``record`` (its step state goes to the ``Ledger``)."""
        return cls(
            closed=record.closed,
            results=OrderedDict((r.request_id, r) for r in record.results),
        )
