"""A stage's step engine: the run/commit state machine around the action loop of one run
(``pipesvc.stage.compute.action_loop``).

No gRPC here: the engine takes the runtime, the mailbox its neighbours' tensors arrive in, a
function per direction that sends a tensor on, and the recorder. The stage service decodes
requests and hands them to it; a test wires several engines together with in-process send
functions and runs whole pipelined steps in one process.

[Note: run and commit] A stage runs one run at a time, in increasing run ids. A training run
leaves its gradients pending until Commit (apply the optimizer step) or Abort (drop them);
until then no other run starts. ``run_lock`` serialises every call that reads or changes the
runtime's state, so state is never read or replaced mid-run or mid-commit.

The coordinator usually defers a decided commit to the next run (see [Note: deferred commit] in
coordinator/ledger.py): ``run_step`` then gets it as ``commit`` and applies it, under the same lock
and fault point as ``commit``, before the run begins; if this stage does not hold that run, the
call fails before anything changes. An abort of a later run than the pending one leaves the
pending gradients alone (that run never began here: it would have committed them first), so
a decided step survives the abort of the run that was to carry its commit.

[Note: run ahead] A run may reach a stage before the run whose commit it carries has begun
there: a stream of training steps sends step N+1's run while step N's runs (see [Note: steps
ahead] in coordinator/step_runner.py). Such a run waits, without holding the run lock, until
run N has begun (or been aborted) here; the run lock then holds it until run N has ended, so
it applies N's commit the moment N's gradients are ready and starts at once, with no word from
the coordinator in between. If run N failed or was aborted here there is nothing to commit, and
the run fails as any run whose carried commit is not the pending one; an abort of the waiting
run ends its wait.

[Note: snapshot checkpoint] A carried commit may ask for a snapshot: right after applying it,
before the run begins, the stage copies its checkpoint state (weights and optimizer state at
that step) to host memory, and the coordinator streams that copy (GetState with
``snapshot_step``) while later runs train, then writes it as the step's checkpoint. The copy
is a memory copy on the step's path; the stream, the files and their syncs are not. It costs
one more copy of the stage's checkpoint state in host memory until it is read (a later
snapshot replaces it; a new assignment drops it).

[Note: per-action cost] On a small model a schedule action's own arithmetic takes tens of µs,
so what the stage does around it counts as much: per run and per action the engine and the
runtime do only what changes between calls. A kind of run's actions, their places and which
backwards are split are worked out once (``_plan``); the timeout messages of waits are built
once; each layer's call plan (seeded or not, side inputs, cache) is fixed when it is built, so a
layer without randomness runs with no generator touched and a stochastic one under its seed as
before (see [Note: training randomness]); autocast and the split backward's hooks are entered
only when on; spans are cheap (see [Note: cheap spans] in ``pipesvc.stage.compute.recorder``). None
of this changes what is computed, or in which order.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipesvc.core.clipping import add_norm_sq, clip_scale
from pipesvc.core.microbatch import CacheRef
from pipesvc.core.schedule import forward_only_actions, stage_actions
from pipesvc.errors import FailedPreconditionError, InvalidArgumentError
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.stage.collective.replica_group import GroupSpec, ReplicaGroup, parked
from pipesvc.stage.compute.action_loop import ActionLoop, RunInputs, RunPlan, SendFn
from pipesvc.stage.compute.faults import FaultKill
from pipesvc.stage.compute.recorder import RunRecorder
from pipesvc.stage.compute.runtime import StageRuntime
from pipesvc.stage.compute.sessions import SessionCaches
from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, NORM_PART, Mailbox, MailKey

logger = logging.getLogger(__name__)

AHEAD_WAIT_S = 600.0
"""How long a run waits for the run whose commit it carries to begin here (see [Note: run
ahead]); the coordinator aborts it long before, when that run fails."""

# RunInputs and SendFn belong to the action loop; callers of the engine take them from here.
__all__ = ["Carried", "RunInputs", "RunResult", "SendFn", "Snapshot", "StepEngine", "TiedSwap"]


class TiedSwap(Protocol):
    """Swaps a training run's partial gradients of tied groups with the stages holding their
    other copies (see [Note: tied parameters] in ``pipesvc.core.tying``)."""

    def swap(self, run_id: int, partials: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Sends this stage's partial sums (group -> tensor) and returns the other stages'."""
        ...

    def abort(self, run_id: int) -> None:
        """Wakes a swap of run ``run_id`` waiting for its peer, which then raises."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """What one run of this stage produced."""

    losses: list[float]
    """Weighted loss of each micro-batch, in order (last stage, training only)."""
    outputs: list[torch.Tensor]
    """Output of each micro-batch, in order (last stage, inference only)."""
    peak_in_flight: int
    """Most micro-batches whose activations were held at once."""
    grad_norm_sq: float | None
    """Squared norm of this stage's gradients (training with clipping only)."""
    generator_states: list[bytes] = field(default_factory=list)
    """Last stage, a run of several decode steps with sampling: each session's generator after
    it (see [Note: sampling on the last stage] in ``pipesvc.coordinator.session``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Carried:
    """A decided commit carried by the next run: its run id and gradient scale, and whether
    to keep a snapshot of the state it leaves (see [Note: snapshot checkpoint])."""

    run_id: int
    grad_scale: float | None
    snapshot: bool = False
    scale_from_links: bool = False
    """The scale is the one the global norm summed along the links gives (see [Note: norm
    along the links] in ``pipesvc.core.clipping``), not ``grad_scale``."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A copy of a stage's checkpoint state (weights and optimizer state) after a step."""

    step: int
    tensors: dict[str, torch.Tensor]


_MAX_PLANS = 64
"""Run plans an engine keeps (one per kind of run it saw; a job uses one or two)."""


class StepEngine:
    """Runs, commits and aborts the steps of one stage of one job (see [Note: run and commit])."""

    def __init__(
        self,
        *,
        runtime: StageRuntime,
        mailbox: Mailbox,
        send_activation: SendFn,
        send_gradient: SendFn,
        recorder: RunRecorder,
        recv_timeout_s: float,
        job_id: str = "",
        downstream_address: str = "",
        metrics: Metrics = NO_METRICS,
        fault_kill: FaultKill | None = None,
        tied: TiedSwap | None = None,
        sessions: SessionCaches | None = None,
        replicas: ReplicaGroup | None = None,
    ) -> None:
        self.runtime = runtime
        self.mailbox = mailbox
        self.recorder = recorder
        self.run_lock = threading.Lock()
        """Held by every call that reads or changes the runtime's state."""
        self._begun = threading.Condition(self.run_lock)
        """Notified when ``last_run_id`` grows (see [Note: run ahead])."""
        self.last_run_id = 0
        """The newest run begun or aborted here; a run must come after it."""
        self.pending_commit: int | None = None
        """The training run whose gradients await Commit or Abort."""
        self._progress_lock = threading.Lock()
        """Held while a commit counts its step and clears ``pending_commit`` (after its
        optimizer step), so that ``progress`` never sees one changed without the other."""
        self._job_id = job_id
        self._metrics = metrics
        self._fault_kill = fault_kill
        self._send_activation = send_activation
        self._send_gradient = send_gradient
        self._recv_timeout_s = recv_timeout_s
        self._norm_total: float | None = None
        """First stage, a job that clips: the pending run's squared global gradient norm,
        summed along the links (see [Note: norm along the links])."""
        self._awaiting_total: tuple[int, int] | None = None
        """(run, the run whose commit it carries) while a run waits for the total."""
        self._tied = tied
        self.replicas = replicas
        """The gradient group with the other replicas' stages of this rank, if any."""
        self.sessions = sessions
        """The generation caches of this stage's layers, per session."""
        self.snapshot: Snapshot | None = None
        """The state a carried commit asked to keep, until it is read."""
        self._snapshot_lock = threading.Lock()
        self._plans: dict[tuple[bool, int], RunPlan] = {}
        """Each kind of run's plan (training or not, micro-batches), see ``_plan``."""
        self._loop = ActionLoop(
            runtime=runtime,
            mailbox=mailbox,
            send_activation=send_activation,
            send_gradient=send_gradient,
            recorder=recorder,
            recv_timeout_s=recv_timeout_s,
            job_id=job_id,
            downstream_address=downstream_address,
            metrics=metrics,
            fault_kill=fault_kill,
            sessions=sessions,
        )

    def run_step(
        self,
        run_id: int,
        *,
        training: bool,
        num_microbatches: int,
        data: RunInputs,
        commit: Carried | None = None,
        generating: bool = False,
    ) -> RunResult:
        """Runs this stage's part of run ``run_id`` after applying the carried ``commit`` (if
        any); a training run then awaits commit.

        Raises:
            FailedPreconditionError: ``run_id`` is not after the last run, the carried commit's
                run is not the one pending here, or a run awaits commit or abort (nothing
                changed).
            InvalidArgumentError: the carried ``grad_scale`` is not finite and non-negative.
            PipesvcError: the run failed (a neighbour, a timeout, an abort); the runtime and
                the run's mail are dropped (the carried commit stays applied).
        """
        if data.caches and self.sessions is None:
            raise FailedPreconditionError("this stage keeps no generation caches")
        with self.run_lock:
            if commit is not None:
                self._await_begun(commit.run_id, run_id)
            refs = self._begin_locked(run_id, data, commit)
            rt = self.runtime
            plan = self._plan(training, num_microbatches)
            rt.begin_run(training, microbatch_offset=data.microbatch_offset)
            grad_norm_sq = None
            try:
                made = self._loop.run(run_id, plan, data, training=training, generating=generating)
                if training:
                    self._settle_gradients(run_id, data.replicas)
                    if rt.config.clip_grad_norm is not None:  # a pass over every gradient
                        grad_norm_sq = rt.grad_norm_sq()
                        if rt.config.data_parallel == 1:
                            self._sum_norms(run_id, grad_norm_sq)
                self._keep_caches(refs)
            except BaseException:
                self._drop_failed(run_id)
                raise
            finally:
                self.mailbox.finish(run_id)
            if training:
                self.pending_commit = run_id
            return RunResult(
                losses=made.losses,
                outputs=made.outputs,
                peak_in_flight=rt.peak_in_flight,
                grad_norm_sq=grad_norm_sq,
                generator_states=made.generator_states,
            )

    def _await_begun(self, carried: int, run_id: int) -> None:
        """Under the run lock: waits until run ``carried`` (before ``run_id``) has begun or
        been aborted here, or ``run_id`` itself has been aborted (see [Note: run ahead])."""
        deadline = time.monotonic() + AHEAD_WAIT_S
        while self.last_run_id < carried < run_id:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FailedPreconditionError(
                    f"run {run_id} carries the commit of run {carried}, which did not reach "
                    f"this stage within {AHEAD_WAIT_S:.0f} s (the last run here is "
                    f"{self.last_run_id})"
                )
            self._begun.wait(left)

    def _begin_locked(self, run_id: int, data: RunInputs, commit: Carried | None) -> list[CacheRef]:
        """Under the run lock: checks that run ``run_id`` may begin, begins its sessions and
        applies the carried ``commit`` (keeping a snapshot if it asks); returns the caches the
        run reads and extends.

        Raises:
            FailedPreconditionError: as ``run_step`` (nothing changed).
        """
        if run_id <= self.last_run_id:
            raise FailedPreconditionError(
                f"run {run_id} is not after the last run {self.last_run_id}"
            )
        if commit is not None:  # before the wait for the total, and before anything changes
            self._check_pending(commit.run_id)
            self._check_commit_fault()
        refs = [ref for refs in data.caches for ref in refs]
        if self.sessions is not None:  # a lost cache fails the run before anything changes
            self.sessions.begin(run_id, refs)
        if commit is not None:
            scale = commit.grad_scale
            if commit.scale_from_links:
                # This stage's newest run from now on, so Info shows it while it waits and a
                # restarted coordinator aborts it (see reconcile's ``_abort_interrupted_run``).
                self.last_run_id = run_id
                self._awaiting_total = (run_id, commit.run_id)
                try:
                    scale = self._scale_from_links(run_id, commit.run_id)
                finally:
                    self._awaiting_total = None
            self._commit_locked(commit.run_id, scale)
            if commit.snapshot:
                self._take_snapshot()
        if self.pending_commit is not None:
            raise FailedPreconditionError(
                f"run {self.pending_commit} awaits commit or abort; run {run_id} waits"
            )
        self.last_run_id = run_id
        self._begun.notify_all()
        return refs

    def _sum_norms(self, run_id: int, own: float) -> None:
        """After a training run of a job that clips: adds this stage's squared gradient norm
        to the later ranks' sum and sends it up; the first stage keeps the total (see [Note:
        norm along the links])."""
        rt = self.runtime
        key = MailKey(run_id, GRADIENT, 0, NORM_PART)
        later = None
        if rt.rank < rt.num_stages - 1:
            later = self._take_norm(key, self._loop.from_downstream)
        total = add_norm_sq(later, own)
        if rt.rank > 0:
            self._send_gradient(key, torch.tensor([total], dtype=torch.float64))
        else:
            self._norm_total = total

    def _scale_from_links(self, run_id: int, carried: int) -> float:
        """The clipping scale of run ``carried``'s commit, which run ``run_id`` carries: from
        the total this stage summed (the first stage) or the one that arrives from upstream,
        passed on downstream before this stage begins (see [Note: norm along the links]).

        Raises:
            FailedPreconditionError: the job does not clip along the links (it has replicas,
                or does not clip), or the first stage holds no total (nothing changed).
            InvalidArgumentError: what arrived is not one float64 of at least 0.
            PipesvcError: the total did not arrive (a timeout, the run's abort, a broken link).
        """
        rt = self.runtime
        max_norm = rt.config.clip_grad_norm
        if max_norm is None or rt.config.data_parallel != 1:
            raise FailedPreconditionError(
                f"run {run_id} carries the commit of run {carried} with its scale from the "
                "links, but this job does not clip gradients along its links (it does not "
                f"clip, or it has {rt.config.data_parallel} replicas)"
            )
        key = MailKey(run_id, ACTIVATION, 0, NORM_PART)
        if rt.rank > 0:
            total = self._take_norm(key, self._loop.from_upstream)
        elif self._norm_total is not None:  # summed at the end of the pending run, ``carried``
            total = self._norm_total
        else:
            raise FailedPreconditionError(
                f"run {run_id} carries the commit of run {carried} with its scale from the "
                "links, but this stage holds no gradient norm for it"
            )
        if rt.rank < rt.num_stages - 1:
            self._send_activation(key, torch.tensor([total], dtype=torch.float64))
        return clip_scale(total, max_norm)

    def _take_norm(self, key: MailKey, source: str) -> float:
        """The squared norm a neighbour sent under ``key``, checked.

        Raises:
            InvalidArgumentError: not one float64 of at least 0 (NaN and infinity pass: the
                coordinator's scale takes them as they are).
        """
        tensor = self.mailbox.get(key, self._recv_timeout_s, source)
        if tensor.dtype != torch.float64 or tensor.numel() != 1:
            raise InvalidArgumentError(
                f"the {key}{source} must be one float64; got {tensor.dtype} of shape "
                f"{list(tensor.shape)}"
            )
        value = float(tensor)
        if value < 0:
            raise InvalidArgumentError(
                f"the {key}{source} is {value!r}; a squared norm is at least 0"
            )
        return value

    def _settle_gradients(self, run_id: int, spec: GroupSpec | None) -> None:
        """After a training run's last action: gives tied copies their group's gradient and
        sums every gradient with the other replicas'."""
        if self.runtime.ties:
            self._share_tied(run_id)
        if self.replicas is not None:
            self._sum_replicas(run_id, spec)

    def _keep_caches(self, refs: list[CacheRef]) -> None:
        """After a run that read and extended caches (``refs``): keeps the prefixes they ask
        for and enforces the sessions' budget (see [Note: generation sessions])."""
        sessions = sorted({ref.session for ref in refs})
        if self.sessions is not None and sessions:
            try:
                self.sessions.keep(refs)
                self.sessions.settle(sessions)
            finally:
                self._session_gauges()

    def _drop_failed(self, run_id: int) -> None:
        """Drops what a failed run left: its activations and gradients, its waits and every
        session as before it."""
        self.runtime.abort()
        self._wake(run_id)
        if self.sessions is not None:  # every session as before the run
            self.sessions.undo(run_id)

    def _wake(self, run_id: int) -> None:
        """Wakes run ``run_id``'s waits and sends (its mail, its tied swap, its gradient
        group), which then raise, and drops its mail."""
        self.mailbox.abort(run_id)
        if self._tied is not None:
            self._tied.abort(run_id)
        if self.replicas is not None:
            self.replicas.abort(run_id)

    def _plan(self, training: bool, num_microbatches: int) -> RunPlan:
        """The actions of a run of ``num_microbatches`` and what the loop needs of them,
        worked out once per kind of run (see [Note: per-action cost])."""
        key = (training, num_microbatches)
        plan = self._plans.get(key)
        if plan is None:
            rt = self.runtime
            if training:
                actions = stage_actions(
                    rt.config.schedule,
                    rank=rt.rank,
                    num_stages=rt.num_stages,
                    num_microbatches=num_microbatches,
                    virtual_stages=len(rt.chunks),
                )
            else:
                actions = forward_only_actions(num_microbatches, len(rt.chunks))
            plan = RunPlan.of(actions)
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _take_snapshot(self) -> None:
        """Copies the checkpoint state to host memory (see [Note: snapshot checkpoint])."""
        rt = self.runtime
        snapshot = Snapshot(
            step=rt.step,
            tensors={k: t.to("cpu", copy=True) for k, t in rt.tensors("checkpoint").items()},
        )
        with self._snapshot_lock:
            self.snapshot = snapshot

    def expire_sessions(self) -> None:
        """Drops the sessions idle past the timeout (the expiry timer's tick), between runs:
        under the run lock, so no run loses a session it has begun."""
        if self.sessions is None:
            return
        with self.run_lock:
            expired = self.sessions.expire()
        if expired:
            self._session_gauges()

    def release_sessions(self, session: str | None) -> int:
        """Drops ``session``'s caches (or a kept prefix of that name; None: every session's)
        between runs, under the run lock as expiry does: a run going on here may hold them
        stacked (see [Note: kept stack] in ``pipesvc.stage.compute.sessions``). Returns the
        bytes freed."""
        if self.sessions is None:
            return 0
        with self.run_lock:
            freed = (
                self.sessions.release_all() if session is None else self.sessions.release(session)
            )
        self._session_gauges()
        return freed

    def _session_gauges(self) -> None:
        """Sets the gauges of the sessions' count and their caches' bytes."""
        assert self.sessions is not None
        self._metrics.set("open_generation_sessions", len(self.sessions.sessions()))
        self._metrics.set("kv_cache_bytes", self.sessions.total_bytes())

    def drop_snapshot(self, step: int) -> None:
        """Drops the snapshot of ``step`` once read (not the run lock: a run may be going)."""
        with self._snapshot_lock:
            if self.snapshot is not None and self.snapshot.step == step:
                self.snapshot = None

    def _share_tied(self, run_id: int) -> None:
        """Gives every tied copy its group's whole gradient (see [Note: tied parameters])."""
        rt = self.runtime
        partials = rt.tied_partials()
        theirs: dict[int, torch.Tensor] = {}
        if partials:
            if self._tied is None:
                raise FailedPreconditionError(
                    f"tied groups {sorted(partials)} are shared with another stage, and this "
                    "stage has no way to reach it"
                )
            theirs = self._tied.swap(run_id, partials)
        rt.settle_ties(theirs)

    def _sum_replicas(self, run_id: int, spec: GroupSpec | None) -> None:
        """Sums every gradient with the other replicas' (see [Note: gradient group])."""
        assert self.replicas is not None
        if spec is None:
            raise InvalidArgumentError(
                f"training run {run_id} of a job with {self.replicas.num_replicas} replicas "
                "names no gradient group"
            )
        try:
            with self.recorder.span("reduce", 0):
                self.replicas.reduce(run_id, spec, self.runtime.settled_parameters())
        finally:
            self._metrics.set("parked_collectives", parked())

    def commit(self, run_id: int, grad_scale: float | None) -> int:
        """Applies the pending run's optimizer step; returns the step count.

        Raises:
            FailedPreconditionError: ``run_id`` is not the run awaiting commit.
            InvalidArgumentError: ``grad_scale`` is not a finite non-negative number.
            ResourceExhaustedError: an injected ``fail`` fault at this commit (``--fault-kill``).
        """
        with self.run_lock:
            self._check_pending(run_id)
            self._check_commit_fault()
            return self._commit_locked(run_id, grad_scale)

    def _check_commit_fault(self) -> None:
        """Under the run lock, with the commit's run pending: the step it commits is the next
        one (a run sent ahead may arrive before the run whose commit it carries has begun, so
        the step is read only once that run is the pending one)."""
        if self._fault_kill is not None:
            self._fault_kill.check(
                when="commit",
                step=self.runtime.step + 1,
                rank=self.runtime.rank,
                microbatch=0,
                last_mb=0,
            )

    def _check_pending(self, run_id: int) -> None:
        if self.pending_commit != run_id:
            raise FailedPreconditionError(
                f"run {run_id} has nothing to commit (pending: {self.pending_commit})"
            )

    def _commit_locked(self, run_id: int, grad_scale: float | None) -> int:
        self._check_pending(run_id)
        self.runtime.apply_step(grad_scale)
        with self._progress_lock:
            step = self.runtime.count_step()
            self.pending_commit = None
        return step

    def progress(self) -> tuple[int, int, int | None]:
        """(step count, newest run, pending run) for ``Info``, which the coordinator's commit
        check and reconciliation read: a commit is seen before (its run pending, while its
        optimizer step runs) or after, never with its step counted and its run still pending.
        The newest run is read alongside; a run beginning or an abort may change it at any
        time."""
        with self._progress_lock:
            return self.runtime.step, self.last_run_id, self.pending_commit

    def abort(self, run_id: int) -> None:
        """Aborts run ``run_id``: wakes its waits and sends, drops its mail, its activations
        and (if it is an uncommitted training run) its gradients; no later run may reuse it.
        A run waiting for the total of a commit of ``run_id`` or earlier is aborted with it: it
        holds the run lock, and it could never apply that commit."""
        awaiting = self._awaiting_total
        if awaiting is not None and awaiting[1] <= run_id:
            self._wake(awaiting[0])
        self._wake(run_id)
        with self.run_lock:
            self.last_run_id = max(self.last_run_id, run_id)
            self._begun.notify_all()
            if self.sessions is not None:  # a generation run that finished here: put back
                self.sessions.undo(run_id)
            if self.pending_commit is not None and run_id > self.pending_commit:
                # A later run that never began here (it would have committed the pending one
                # first): the pending gradients are a decided step's, kept for its commit.
                logger.info(
                    "job %s: run %d aborted before it began; run %d stays pending",
                    self._job_id,
                    run_id,
                    self.pending_commit,
                    extra={"job": self._job_id, "rank": self.runtime.rank},
                )
                return
            self.pending_commit = None
            self.runtime.abort()
        logger.info(
            "job %s: run %d aborted",
            self._job_id,
            run_id,
            extra={"job": self._job_id, "rank": self.runtime.rank},
        )
