"""The stages serving one job: its plan and plan epoch, and the calls that go to all of them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar

from google.protobuf.message import Message

from pipesvc.coordinator.commit import commit_all
from pipesvc.coordinator.replicas import Rendezvous, RunReplies
from pipesvc.coordinator.stage_calls import (
    Deadlines,
    Meanwhile,
    StageLostError,
    UnaryMethod,
    call_all,
    call_stage,
    gather,
    patient_health,
    stream_stage,
    where,
)
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.coordinator.state_io import load_into_stages
from pipesvc.core import microbatch
from pipesvc.core.config import JobConfig, config_to_proto
from pipesvc.core.health import Health
from pipesvc.core.loss import loss_units
from pipesvc.core.microbatch import MicrobatchCaches, RunBatch
from pipesvc.core.plan import PipelineStage, replicas_of, servers_of
from pipesvc.core.sampling import RowsSampling
from pipesvc.core.tensor_codec import payload_view
from pipesvc.errors import (
    FailedPreconditionError,
    PipelineTimeoutError,
    PipesvcError,
    StepAbortedError,
)
from pipesvc.v1 import common_pb2, stage_pb2
from pipesvc.wire.control_wire import Kind
from pipesvc.wire.payload_wire import Payloads

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

logger = logging.getLogger(__name__)


def _sampling_message(plan: RowsSampling) -> stage_pb2.StepSampling:
    """How the last stage picks a session's tokens (see [Note: sampling on the last stage] in
    ``session.py``), as the wire carries it."""
    return stage_pb2.StepSampling(
        rows=[stage_pb2.RowRange(start=a, end=b) for a, b in plan.rows],
        temperature=plan.sampling.temperature,
        top_k=plan.sampling.top_k or 0,
        top_p=plan.sampling.top_p or 0.0,
        generator_state=plan.state,
    )


def _cache_messages(caches: Sequence[MicrobatchCaches]) -> list[stage_pb2.MicrobatchCaches]:
    """Each micro-batch's cache references (generation) on the wire."""
    return [
        stage_pb2.MicrobatchCaches(
            refs=[
                stage_pb2.CacheRef(
                    session=c.session,
                    part=c.part,
                    fresh=c.fresh,
                    rows=c.rows,
                    positions=c.positions,
                    source=c.source,
                    source_positions=c.source_positions,
                    keep_as=c.keep_as,
                    keep_positions=c.keep_positions,
                )
                for c in refs
            ]
        )
        for refs in caches
    ]


def _without_snapshot(commit: stage_pb2.CarriedCommit | None) -> stage_pb2.CarriedCommit | None:
    """The carried ``commit`` as replicas other than 0 get it: only replica 0 keeps a snapshot,
    since checkpoints read it alone."""
    if commit is None or not commit.snapshot:
        return commit
    others = stage_pb2.CarriedCommit()
    others.CopyFrom(commit)
    others.snapshot = False
    return others


class StageGroup:
    """A job's plan on stage servers. The plan and epoch change only when the job is rebuilt
    (``Recovery``); every call here goes out under the current ones."""

    def __init__(
        self,
        *,
        job_id: str,
        config: JobConfig,
        layers: list[stage_pb2.LayerDescription],
        plan: list[PipelineStage],
        epoch: int,
        registry: StageRegistry,
        deadlines: Deadlines,
        pool: futures.ThreadPoolExecutor,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self.job_id = job_id
        self.config = config
        self.layers = layers
        self.plan = plan
        self.registry = registry
        self._epoch = epoch
        self.deadlines = deadlines
        self._pool = pool
        self.rendezvous = rendezvous
        """Where the gradient groups of a job with replicas meet (see [Note: replicas])."""
        self.generation = 0
        """Bumped by every abort: a later run's gradient groups are new (see [Note: gradient
        group] in ``pipesvc.stage.collective.replica_group``)."""

    @property
    def epoch(self) -> int:
        """The plan epoch every call goes out under."""
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        """A new plan epoch: the job's Control streams of the old one close (see [Note:
        control stream]); the next call opens new ones."""
        self._epoch = epoch
        self.registry.control.close_other_epochs(self.job_id, epoch)

    @property
    def pipelines(self) -> list[list[PipelineStage]]:
        """The plan's replicas, each a pipeline in rank order (one without replicas)."""
        return replicas_of(self.plan)

    @property
    def primary(self) -> list[PipelineStage]:
        """Replica 0's stage servers: the ones checkpoints, state reads and generation use."""
        return servers_of(self.pipelines[0])

    @property
    def servers(self) -> list[PipelineStage]:
        """One entry per stage server (its chunk 0; see [Note: virtual stages]), plan order:
        what every call to the stages goes to."""
        return servers_of(self.plan)

    @property
    def addresses(self) -> list[str]:
        """The plan's stage addresses, in rank order (each server once)."""
        return [s.address for s in self.servers]

    def describe(self) -> str:
        """The plan as log lines show it: each stage's layer range and address (and replica,
        with replicas)."""
        pipelines = self.pipelines
        return "; ".join(
            (f"replica {p[0].replica}: " if len(pipelines) > 1 else "")
            + ", ".join(
                f"[{s.start_layer},{s.end_layer})@{s.address}"
                + (f" chunk {s.chunk}" if s.chunk else "")
                for s in p
            )
            for p in pipelines
        )

    def plan_protos(self) -> list[common_pb2.PlanStage]:
        """The plan on the wire."""
        return [s.to_proto() for s in self.plan]

    def health(self) -> dict[str, Health]:
        """Each stage's health status, checked in parallel; UNREACHABLE for a stage that is
        gone or left ``health_failures`` checks in a row unanswered (see
        ``stage_calls.patient_health``)."""
        return patient_health(self.registry, self.addresses, self.deadlines)

    def call_all(
        self,
        method: UnaryMethod[_Req, _Resp],
        make: Callable[[PipelineStage], _Req],
        timeout_s: float,
        **kw: Any,
    ) -> list[_Resp]:
        """``method`` (``lambda stub: stub.Info``) on every stage server at once, with
        ``make(stage)`` as its request (see ``stage_calls.call_all`` for ``kw``); the replies
        in the order of ``servers``."""
        return call_all(
            self.registry, self.servers, lambda stub, s: (method(stub), make(s)), timeout_s, **kw
        )

    def run_step(
        self,
        run_id: int,
        mode: stage_pb2.RunMode.ValueType,
        batch: RunBatch,
        *,
        what: str,
        commit: stage_pb2.CarriedCommit | None = None,
    ) -> RunReplies:
        """One pipelined run on every stage under the health watchdog: each replica runs its
        share of the micro-batches (see [Note: replicas]; generation runs on replica 0), the
        inputs going to its first stage, the targets (none for inference) to its last, the
        side inputs to all its stages; every stage of the plan first applies the carried
        ``commit`` (see [Note: deferred commit]). ``send_run`` is its first half, for a caller
        that works (or sends another run) before it awaits the replies.

        Raises:
            StageLostError: the watchdog declared a stage lost (the caller aborts the run).
            PipesvcError: the first root-cause error of any stage, naming it.
        """
        return self.send_run(run_id, mode, batch, what=what, commit=commit).replies()

    def send_run(
        self,
        run_id: int,
        mode: stage_pb2.RunMode.ValueType,
        batch: RunBatch,
        *,
        what: str,
        commit: stage_pb2.CarriedCommit | None = None,
    ) -> SentRun:
        """``run_step``'s requests, sent to every stage; ``SentRun.replies`` awaits them."""
        inputs, targets = batch.inputs, batch.targets
        units = [loss_units(self.config.loss, t) for t in targets]
        weights = microbatch.loss_weights(units) if targets else []
        assert mode != stage_pb2.GENERATE or self.config.virtual_stages == 1  # refused before
        pipelines = [servers_of(p) for p in self.pipelines]
        shares = self.shares(mode, len(inputs))
        group = self._replica_group() if mode == stage_pb2.TRAIN and len(pipelines) > 1 else None
        # Each tensor's bytes are viewed once and appended to every request that carries it
        # (see [Note: payload wire]): a micro-batch is a view of the batch as received.
        input_views = [payload_view(t) for t in inputs]
        target_views = [payload_view(t) for t in targets]
        side_views = [{n: payload_view(t) for n, t in side.items()} for side in batch.side]
        caches = _cache_messages(batch.caches)
        sampling = [_sampling_message(plan) for plan in batch.sampling]  # the last stage's
        others_commit = _without_snapshot(commit)
        share_of = {p[0].replica: share for p, share in zip(pipelines, shares, strict=True)}
        last = len(pipelines[0]) - 1

        def request(stage: PipelineStage) -> tuple[stage_pb2.RunStepRequest, list[memoryview]]:
            share = share_of[stage.replica]
            part = slice(share.start, share.stop)
            is_last = stage.rank == last
            payloads = Payloads()
            message = stage_pb2.RunStepRequest(
                job_id=self.job_id,
                plan_epoch=self.epoch,
                run_id=run_id,
                mode=mode,
                num_microbatches=len(share),
                inputs=[payloads.add(*v) for v in input_views[part]] if stage.rank == 0 else [],
                targets=[payloads.add(*v) for v in target_views[part]] if is_last else [],
                loss_weights=weights[part] if is_last and targets else [],
                commit=commit if stage.replica == 0 else others_commit,
                side_inputs=[
                    stage_pb2.SideInputs(tensors={n: payloads.add(*v) for n, v in side.items()})
                    for side in side_views[part]
                ],
                caches=caches[part],
                greedy=batch.greedy,
                decode_steps=batch.decode_steps,
                sampling=sampling if is_last else [],
                microbatch_offset=share.start,
                replicas=group,
            )
            return message, payloads.views

        # A replica with no share (a batch smaller than the replicas, or generation) sits the
        # run out; a carried commit must reach every stage, so the caller flushed it first.
        taking_part = [p for p, share in zip(pipelines, shares, strict=True) if len(share)]
        assert commit is None or len(taking_part) == len(pipelines), "flush the commit first"
        stages = [s for p in taking_part for s in p]
        calls = [
            self._send(stage, "run", *request(stage), self.deadlines.step_s) for stage in stages
        ]
        return SentRun(self, taking_part, calls, what)

    def no_stage_past(self, step: int) -> bool:
        """Whether every stage of the plan answers that it is at ``step`` or before it (False
        also when one cannot say)."""
        try:
            infos = self.call_all(
                lambda stub: stub.Info, lambda s: stage_pb2.InfoRequest(), self.deadlines.control_s
            )
        except PipesvcError as exc:
            logger.warning("job %s: could not ask the stages where they are: %s", self.job_id, exc)
            return False
        return all(i.job_id == self.job_id and i.step <= step for i in infos)

    def shares(self, mode: stage_pb2.RunMode.ValueType, count: int) -> list[range]:
        """Which of a run's ``count`` micro-batches each replica runs (see [Note: replicas]):
        contiguous shares, or everything on replica 0 for generation (its caches live there)."""
        replicas = len(self.pipelines)
        if mode == stage_pb2.GENERATE:
            return [range(count)] + [range(0)] * (replicas - 1)
        return microbatch.replica_shares(count, replicas)

    def _replica_group(self) -> stage_pb2.ReplicaGroup:
        if self.rendezvous is None:
            raise FailedPreconditionError(
                f"job {self.job_id} has {len(self.pipelines)} replicas but this coordinator "
                "serves no gradient-group store"
            )
        return self.rendezvous.spec(self.job_id, self.epoch, self.generation)

    def _send(
        self,
        stage: PipelineStage,
        kind: Kind,
        message: Message,
        payloads: Sequence[memoryview],
        timeout_s: float,
    ) -> futures.Future[Any]:
        """``message`` to ``stage`` on the job's Control stream (see [Note: control stream])."""
        return self.registry.control.send(
            stage.address,
            job_id=self.job_id,
            epoch=self.epoch,
            kind=kind,
            message=message,
            payloads=payloads,
            timeout_s=timeout_s,
        )

    def commit(
        self, request: stage_pb2.CommitRequest, *, step: int, after_failed_run: bool = False
    ) -> None:
        """Commits ``request.run_id`` (training step ``step``) on every stage, over the
        Control streams and under the health watchdog; returns once every stage reports the
        step (see [Note: commit invariant] in commit.py). A first round that fails for any
        reason but a lost stage goes on as ``commit_all`` does: it asks every stage where it
        is and commits again where the run is still pending (``after_failed_run``: only that).

        Raises:
            StageLostError: a stage stopped answering health checks (it is to be replaced).
            CommitIncompleteError: some stage could not be brought to the step.
        """
        if not after_failed_run:
            servers = self.servers
            deadlines = self.deadlines
            calls = [self._send(s, "commit", request, (), deadlines.control_s) for s in servers]
            try:
                gather(
                    self.registry,
                    servers,
                    calls,
                    deadlines=deadlines,
                    what=f"commit of step {step}",
                    timeout_s=deadlines.control_s,
                )
                return
            except StageLostError:
                raise
            except PipesvcError as exc:
                logger.warning(
                    "commit of step %d failed: %s; committing again where it is pending", step, exc
                )
                # Its other commits land before the stages are asked where they are.
                futures.wait(calls, timeout=deadlines.control_s)
        commit_all(
            self.registry,
            self.servers,
            request,
            step=step,
            deadlines=self.deadlines,
            after_failed_run=True,
        )

    def abort(self, run_id: int, *, lost: Collection[str] = ()) -> None:
        """Aborts run ``run_id`` on every stage at once (best effort on each: it may be dead),
        except the ``lost`` addresses: a stage the watchdog found stopped would only make the
        abort wait for its deadline before recovery could start. The abort goes on each
        stage's Control stream, where it overtakes the run if that still computes."""
        request = stage_pb2.AbortRequest(job_id=self.job_id, plan_epoch=self.epoch, run_id=run_id)
        self.generation += 1
        alive = [s for s in self.servers if s.address not in lost]
        timeout_s = self.deadlines.abort_s
        calls = [(s, self._send(s, "abort", request, (), timeout_s)) for s in alive]
        ends_at = time.monotonic() + timeout_s
        for stage, call in calls:
            try:
                call.result(timeout=max(0.0, ends_at - time.monotonic()))
            except futures.TimeoutError:
                call.cancel()
                error: Exception = PipelineTimeoutError("Deadline Exceeded")
            except futures.CancelledError:
                error = StepAbortedError("the call was cancelled")
            except PipesvcError as exc:
                error = exc
            else:
                continue
            logger.warning(
                "job %s: abort of run %d on %s failed: %s", self.job_id, run_id, where(stage), error
            )

    def release(self, stage: PipelineStage) -> None:
        """Tells a stage to drop this job (best effort: it may be gone), closing the job's
        Control stream to it first."""
        self.registry.control.close(job_id=self.job_id, address=stage.address)
        try:
            call_stage(
                self.registry,
                stage,
                lambda stub: stub.Release,
                stage_pb2.ReleaseRequest(job_id=self.job_id),
                self.deadlines.abort_s,
            )
        except PipesvcError as exc:
            logger.warning("job %s: release of %s failed: %s", self.job_id, where(stage), exc)

    def assign(self) -> None:
        """Gives every stage its place in the plan under the current epoch."""
        spec = config_to_proto(self.config)
        pipelines = {p[0].replica: p for p in self.pipelines}

        def assign(stage: PipelineStage) -> stage_pb2.AssignRequest:
            plan = pipelines[stage.replica]
            ring = servers_of(plan)
            if self.config.virtual_stages > 1:  # the last stage feeds the first one's chunks
                downstream = ring[(stage.rank + 1) % len(ring)].address
            else:
                downstream = ring[stage.rank + 1].address if stage.rank + 1 < len(ring) else ""
            return stage_pb2.AssignRequest(
                job_id=self.job_id,
                plan_epoch=self.epoch,
                spec=spec,
                stage=stage.to_proto(),
                num_stages=len(ring),
                downstream_address=downstream,
                plan=[entry.to_proto() for entry in plan],
                num_replicas=len(pipelines),
            )

        self.call_all(lambda stub: stub.Assign, assign, self.deadlines.control_s)

    def stream_state(
        self,
        kind: common_pb2.StateKind.ValueType,
        *,
        snapshot_step: int | None = None,
        plan: Sequence[PipelineStage] | None = None,
    ) -> Iterator[common_pb2.TensorFrame]:
        """Every stage's tensors of ``kind`` (of ``plan``, by default the current one's first
        replica) in layer order, frame by frame, each stream under the health watchdog; with
        ``snapshot_step``, the snapshots the stages took after that step's commit."""
        request = stage_pb2.GetStateRequest(job_id=self.job_id, kind=kind)
        if snapshot_step is not None:
            request.snapshot_step = snapshot_step
        for stage in list(self.primary if plan is None else plan):
            yield from stream_stage(
                self.registry,
                stage,
                lambda stub: stub.GetState,
                request,
                self.deadlines.control_s,
                deadlines=self.deadlines,
                what=f"reading its state ({common_pb2.StateKind.Name(kind).lower()})",
            )

    def load_state(self, frames: Iterable[common_pb2.TensorFrame], step: int | None) -> int:
        """Loads a full state into every stage, each its own layers (see ``state_io``);
        returns the number of tensors.

        Raises:
            InvalidArgumentError: unknown or missing keys, or a shape or dtype mismatch.
        """
        return load_into_stages(
            self.registry,
            self.job_id,
            self.plan,
            self.layers,
            frames,
            timeout_s=self.deadlines.control_s,
            step=step,
            pool=self._pool,
        )


class SentRun:
    """A run's requests, sent to every stage taking part; ``replies`` awaits them."""

    def __init__(
        self,
        group: StageGroup,
        pipelines: list[list[PipelineStage]],
        calls: list[futures.Future[Any]],
        what: str,
    ) -> None:
        self.epoch = group.epoch
        """The plan epoch it was sent in."""
        self._group, self._pipelines, self._calls, self._what = group, pipelines, calls, what

    def replies(self, meanwhile: Meanwhile | None = None) -> RunReplies:
        """Gathers every stage's reply under the health watchdog, grouped by replica, doing
        ``meanwhile`` as ``gather`` does.

        Raises:
            as ``StageGroup.run_step``.
        """
        group = self._group
        stages = [s for p in self._pipelines for s in p]
        deadlines = group.deadlines
        replies: list[stage_pb2.RunStepResponse] = gather(
            group.registry,
            stages,
            self._calls,
            deadlines=deadlines,
            what=self._what,
            timeout_s=deadlines.step_s,
            meanwhile=meanwhile,
        )
        by_replica: list[list[stage_pb2.RunStepResponse]] = []
        index = 0
        for pipeline in self._pipelines:
            by_replica.append(replies[index : index + len(pipeline)])
            index += len(pipeline)
        return RunReplies(by_replica=by_replica)
