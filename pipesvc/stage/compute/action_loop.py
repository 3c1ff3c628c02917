"""The action loop of one run of a stage: each schedule action's waits for its neighbours'
tensors, its compute on the runtime and its sends, in the order of the run's plan (no gRPC
here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipesvc.core.microbatch import MicrobatchCaches
from pipesvc.core.sampling import RowsSampling, choose_rows, generator_from, generator_state
from pipesvc.core.schedule import Action, ActionKind
from pipesvc.errors import FailedPreconditionError
from pipesvc.observe.metrics import Metrics
from pipesvc.stage.collective.replica_group import GroupSpec
from pipesvc.stage.compute import fused_cache
from pipesvc.stage.compute.faults import FaultKill
from pipesvc.stage.compute.recorder import RunRecorder
from pipesvc.stage.compute.runtime import StageRuntime
from pipesvc.stage.compute.sessions import SessionCaches
from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey

SendFn = Callable[[MailKey, torch.Tensor], None]
"""Sends one tensor to a neighbour (waits while its queue is full; raises if it cannot)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunInputs:
    """A run's data: inputs on the first stage, targets and loss weights on the last, and
    each micro-batch's side inputs on every stage (see [Note: side inputs])."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    loss_weights: list[float]
    side: list[dict[str, torch.Tensor]] = field(default_factory=list)
    caches: list[MicrobatchCaches] = field(default_factory=list)
    """Generation: the caches each micro-batch reads and extends (see [Note: generation
    sessions]; several when sessions' decode steps are fused, see [Note: fused decode]); empty
    otherwise."""
    greedy: bool = False
    """Generation: the last stage returns each row's most likely next token (int64), not its
    next-token logits."""
    decode_steps: int = 1
    """Generation: decode steps the run takes (see [Note: decode steps on the stages] in
    ``pipesvc.coordinator.session``)."""
    sampling: list[RowsSampling] = field(default_factory=list)
    """Last stage, a run of several decode steps that is not greedy: how each session's rows
    pick their tokens (see [Note: sampling on the last stage] there)."""
    microbatch_offset: int = 0
    """The step-wide index of the run's first micro-batch (a replica's share starts after the
    shares before it); training randomness is drawn per step-wide index."""
    replicas: GroupSpec | None = None
    """Training with replicas: where this stage's gradient group meets."""


@dataclass(frozen=True, slots=True)
class LoopResult:
    """What the loop made of one run on this stage."""

    losses: list[float]
    """Each micro-batch's loss, in order (last stage, training)."""
    outputs: list[torch.Tensor]
    """Each micro-batch's output, in order (last stage, inference and generation)."""
    generator_states: list[bytes] = field(default_factory=list)
    """Last stage, a run of several decode steps with sampling: each session's generator
    state after it (see [Note: sampling on the last stage] in
    ``pipesvc.coordinator.session``)."""


@dataclass(frozen=True, slots=True)
class Place:
    """Where an action is: its micro-batch, its chunk, and the run's micro-batch count.

    [Note: chunk mail] On the links a tensor for chunk ``c`` of micro-batch ``i`` travels as
    micro-batch ``c * count + i`` of the run (``wire``), so the frames, shared memory and the
    mailbox need no notion of chunks; with one chunk it is ``i``.
    """

    microbatch: int
    chunk: int
    count: int

    def wire(self, chunk: int) -> int:
        """The micro-batch index this micro-batch's tensor for ``chunk`` travels as."""
        return chunk * self.count + self.microbatch


@dataclass(frozen=True, slots=True)
class RunPlan:
    """A run's actions as the loop takes them: per action its kind, its place and whether its
    backward is split (a ``W`` follows), and the run's last forward micro-batch."""

    steps: tuple[tuple[ActionKind, Place, bool], ...]
    last_mb: int

    @staticmethod
    def of(actions: list[Action]) -> RunPlan:
        """The plan of a run of ``actions`` (this stage's, in order)."""
        split = {(a.microbatch_index, a.chunk) for a in actions if a.kind is ActionKind.WEIGHT}
        last_mb = sum(a.kind is ActionKind.FORWARD for a in actions) - 1
        count = sum(a.kind is ActionKind.FORWARD and a.chunk == 0 for a in actions)
        steps = tuple(
            (
                a.kind,
                Place(a.microbatch_index, a.chunk, count),
                a.kind is ActionKind.FORWARD and (a.microbatch_index, a.chunk) in split,
            )
            for a in actions
        )
        return RunPlan(steps, last_mb)


class ActionLoop:
    """Takes the actions of a stage's runs one by one: waits for what an action needs from a
    neighbour, computes it on the runtime and sends what it produced on (see [Note: run and
    commit] in ``pipesvc.stage.compute.engine`` for the run around it)."""

    def __init__(
        self,
        *,
        runtime: StageRuntime,
        mailbox: Mailbox,
        send_activation: SendFn,
        send_gradient: SendFn,
        recorder: RunRecorder,
        recv_timeout_s: float,
        job_id: str,
        downstream_address: str,
        metrics: Metrics,
        fault_kill: FaultKill | None,
        sessions: SessionCaches | None,
    ) -> None:
        self.runtime = runtime
        self.mailbox = mailbox
        self.recorder = recorder
        self.sessions = sessions
        self._send_activation = send_activation
        self._send_gradient = send_gradient
        self._recv_timeout_s = recv_timeout_s
        self._job_id = job_id
        self._metrics = metrics
        self._fault_kill = fault_kill
        self._chunked_runs = 0
        """Generation runs of several micro-batches so far (what ``prefill`` faults count)."""
        # What a wait for a neighbour names in its timeout's message (see Mailbox.get); the
        # engine's waits for the gradient norm name them too.
        self.from_upstream = f" from rank {(runtime.rank - 1) % runtime.num_stages}"
        self.from_downstream = (
            f" from rank {(runtime.rank + 1) % runtime.num_stages} ({downstream_address})"
        )

    def run(
        self,
        run_id: int,
        plan: RunPlan,
        data: RunInputs,
        *,
        training: bool,
        generating: bool = False,
    ) -> LoopResult:
        """Takes the actions of ``plan`` for run ``run_id`` on ``data`` (or its decode steps);
        returns the losses (last stage, training) and outputs (last stage, inference) of its
        micro-batches, in order. The caller has begun the run on the runtime and drops it if
        this raises."""
        rt = self.runtime
        rec = self.recorder
        rec.begin(run_id, rt.step + 1 if training else 0, job_id=self._job_id, rank=rt.rank)
        losses: dict[int, float] = {}
        outputs: dict[int, torch.Tensor] = {}
        fault_kill, fault_when, fault_step = self._fault_kill, "", 0
        if fault_kill is not None and training:
            fault_step = rt.step + 1
        elif fault_kill is not None and generating and plan.last_mb > 0:
            self._chunked_runs += 1
            fault_when, fault_step = "prefill", self._chunked_runs
        else:
            fault_kill = None
        if data.decode_steps > 1:
            made = self._decode(run_id, data)
            rec.end(training=training, generating=generating)
            return made
        for kind, at, split_here in plan.steps:
            if fault_kill is not None:
                fault_kill.check(
                    when=fault_when or ("forward" if kind is ActionKind.FORWARD else "backward"),
                    step=fault_step,
                    rank=rt.rank,
                    microbatch=at.microbatch,
                    last_mb=plan.last_mb,
                )
            if kind is ActionKind.FORWARD:
                self._forward(
                    run_id, at, data, training, losses, outputs, generating, split=split_here
                )
            elif kind is ActionKind.BACKWARD:
                self._backward(run_id, at)
            else:
                with rec.span("weight", at.microbatch):
                    rt.backward_weight(at.microbatch, at.chunk)
                self._metrics.set("microbatches_in_flight", rt.live)
        rec.end(training=training, generating=generating)
        return LoopResult(
            [losses[i] for i in sorted(losses)], [outputs[i] for i in sorted(outputs)]
        )

    def _forward(
        self,
        run_id: int,
        at: Place,
        data: RunInputs,
        training: bool,
        losses: dict[int, float],
        outputs: dict[int, torch.Tensor],
        generating: bool = False,
        *,
        split: bool = False,
    ) -> None:
        rt, rec = self.runtime, self.recorder
        mb, chunk = at.microbatch, at.chunk
        cache, stacked = self._microbatch_cache(data, mb)
        carries = training and rt.features.carry is not None
        carry = None
        if rt.first_virtual(chunk):
            x = data.inputs[mb]
        else:
            x, carry = self._receive(
                MailKey(run_id, ACTIVATION, at.wire(chunk)), mb, carries, self.from_upstream
            )
        with rec.span("forward", mb):
            side = data.side[mb] if data.side else None
            y = rt.forward(
                mb,
                x,
                training=training,
                side=side,
                cache=cache,
                split_backward=split,
                chunk=chunk,
                carry=carry,
                last_position=generating,
            )
            if stacked is not None:
                assert self.sessions is not None
                self.sessions.fused_done(data.caches[mb], stacked)
                stacked = cache = None  # the run holds no cache past its forward
            last = rt.last_virtual(chunk)
            if last and training:
                loss = rt.loss(mb, data.targets[mb], data.loss_weights[mb])
                losses[mb] = float(loss.detach())  # float() of a tensor needing grad warns
        self._metrics.set("microbatches_in_flight", rt.live)
        if not last:
            self._send_output(run_id, at, y, training=training, carries=carries)
        elif generating and data.greedy:
            outputs[mb] = y[:, -1].argmax(dim=-1)  # the most likely next token of each row
        elif generating:
            outputs[mb] = y[:, -1].contiguous()  # the next token's logits only
        elif not training:
            outputs[mb] = y

    def _decode(self, run_id: int, data: RunInputs) -> LoopResult:
        """Takes a run's ``data.decode_steps`` decode steps of its one micro-batch (see
        [Note: decode steps on the stages] in ``pipesvc.coordinator.session``): each step's
        forward on the same caches, its activation on to the next stage, and the tokens the
        last stage picks (the most likely, or drawn as ``data.sampling`` says) back up the
        pipeline (on the gradient direction, each stage passing them on) as the first stage's
        next inputs. On the last stage, the result's output is the tokens, int64 ``[steps,
        rows]``, beside the sessions' generator states after the run."""
        rt, rec = self.runtime, self.recorder
        steps = data.decode_steps
        first, last = rt.is_first, rt.is_last
        cache, stacked = self._microbatch_cache(data, 0)
        side = data.side[0] if data.side else {}
        x = data.inputs[0] if first else None
        made: list[torch.Tensor] = []
        # See [Note: sampling on the last stage] in ``pipesvc.coordinator.session``.
        generators = [
            None if plan.sampling.greedy else generator_from(plan.state) for plan in data.sampling
        ]
        for step in range(steps):
            more = step + 1 < steps
            if not first:
                x, _ = self._receive(
                    MailKey(run_id, ACTIVATION, step), 0, False, self.from_upstream
                )
            assert x is not None
            with rec.span("forward", 0):
                y = rt.forward(0, x, training=False, side=_step_side(side, step), cache=cache)
            if not last:
                with rec.span("send", 0):
                    self._send_activation(MailKey(run_id, ACTIVATION, step), y)
                if more:  # this step's tokens, from the last stage, on to the first
                    tokens, _ = self._receive(
                        MailKey(run_id, GRADIENT, step), 0, False, self.from_downstream
                    )
                    if first:
                        x = tokens
                    else:
                        self._send_gradient(MailKey(run_id, GRADIENT, step), tokens)
                continue
            if data.sampling:
                chosen = choose_rows(y[:, -1], data.sampling, generators)
            else:
                chosen = y[:, -1].argmax(dim=-1)  # each row's most likely next token
            made.append(chosen)
            if more and first:  # one stage: its own next inputs
                x = chosen[:, None]
            elif more:
                self._send_gradient(MailKey(run_id, GRADIENT, step), chosen[:, None])
        if stacked is not None:
            assert self.sessions is not None
            self.sessions.fused_done(data.caches[0], stacked)
        if not last:
            return LoopResult([], [])
        states = [b"" if g is None else generator_state(g) for g in generators]
        return LoopResult([], [torch.stack(made)], states)

    def _receive(
        self, key: MailKey, mb: int, carries: bool, sender: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Waits for the tensor under ``key`` from a neighbour (``sender`` names it in a
        timeout's message) and, when the model carries a vector, for its part 1 (see [Note:
        carried vector] in pipesvc.models.carry); counted as micro-batch ``mb``'s wait."""
        with self.recorder.span("wait", mb):
            tensor = self.mailbox.get(key, self._recv_timeout_s, sender)
            if not carries:
                return tensor, None
            part = MailKey(key.run_id, key.direction, key.microbatch_index, part=1)
            return tensor, self.mailbox.get(part, self._recv_timeout_s, sender)

    def _microbatch_cache(
        self, data: RunInputs, mb: int
    ) -> tuple[Any, fused_cache.StackedCaches | None]:
        """The generation cache micro-batch ``mb`` reads and extends, and, when it fuses
        several sessions' caches (see [Note: fused decode]), their stack to split afterwards.

        Raises:
            FailedPreconditionError: the model cannot fuse caches.
        """
        if not data.caches:
            return None, None
        assert self.sessions is not None  # checked when the run began
        rt, refs = self.runtime, data.caches[mb]
        if len(refs) == 1:
            return self.sessions.get(refs[0]), None
        layout = rt.features.cache_layout
        if layout is None or not rt.features.fuses_caches:
            raise FailedPreconditionError(
                f"model {rt.config.model!r} cannot fuse sessions' caches in a micro-batch"
            )
        stacked = self.sessions.fused(refs)
        return stacked.cache, stacked

    def _send_output(
        self, run_id: int, at: Place, y: torch.Tensor, *, training: bool, carries: bool
    ) -> None:
        """Sends a forward's output (and its carried vector) to the next virtual stage: this
        chunk on the next rank, or the next chunk on rank 0."""
        rt, mb, chunk = self.runtime, at.microbatch, at.chunk
        after = chunk + 1 if rt.rank == rt.num_stages - 1 else chunk
        with self.recorder.span("send", mb):
            started = time.perf_counter()
            self._send_activation(MailKey(run_id, ACTIVATION, at.wire(after)), y)
            total = rt.carried(mb, chunk) if carries else None
            if total is not None:
                self._send_activation(MailKey(run_id, ACTIVATION, at.wire(after), part=1), total)
            if training:
                rt.profiler.sent(y.numel() * y.element_size(), time.perf_counter() - started)

    def _backward(self, run_id: int, at: Place) -> None:
        rt, rec = self.runtime, self.recorder
        mb, chunk = at.microbatch, at.chunk
        grad = carry_grad = None
        carries = rt.features.carry is not None
        if not rt.last_virtual(chunk):
            grad, carry_grad = self._receive(
                MailKey(run_id, GRADIENT, at.wire(chunk)), mb, carries, self.from_downstream
            )
        with rec.span("backward", mb):
            grad_input = rt.backward(mb, grad, chunk, carry_grad)
        self._metrics.set("microbatches_in_flight", rt.live)
        if grad_input is not None:
            # The virtual stage before: this chunk on the rank before, or the chunk before on
            # the last rank.
            before = chunk - 1 if rt.rank == 0 else chunk
            with rec.span("send", mb):
                self._send_gradient(MailKey(run_id, GRADIENT, at.wire(before)), grad_input)
                start_grad = rt.carried_grad(mb, chunk) if carries else None
                if start_grad is not None:
                    self._send_gradient(
                        MailKey(run_id, GRADIENT, at.wire(before), part=1), start_grad
                    )


def _step_side(side: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The side inputs of decode step ``step`` of a run from its first step's: each row's
    padding mask one real position longer per step, and its position one further."""
    if not step:
        return side
    out = dict(side)
    if "attention_mask" in side:
        mask = side["attention_mask"]
        out["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], step)], dim=1)
    if "position_ids" in side:
        out["position_ids"] = side["position_ids"] + step
    return out
