"""A stage's compute: its layers, optimizer, and the forward/backward/commit of one run.

This module owns no threads and no network; the stage service drives it.

[Note: activation ownership] ``forward`` keeps the input (with grad) and output of each
micro-batch until its ``backward``; the output tensor is handed to the sender as is and is never
modified in place, so it can be sent while compute goes on.

[Note: train and eval mode] A training run puts the layers in training mode and runs each
layer that draws random numbers under the seed of [Note: training randomness]
(``pipesvc.models.rng``), for the step being computed (``step + 1``), so a replayed step draws
the masks of its first attempt. An inference run (``Job.forward``, generation) puts them in eval
mode: no dropout, BatchNorm's running statistics; the mode is switched only when it changes.

[Note: gradients of the last committed step] ``tensors("gradients")`` reports the gradients of
the last committed step. Only a training run replaces them (it zeroes them in ``begin_run``), so
only the abort of a training run that has begun here and not been committed drops them; the
abort of an inference run, or of a run this stage never began, leaves them as they are.

[Note: precision] ``fp32`` computes and stores everything in float32. ``bf16-mixed`` keeps
float32 weights, gradients and optimizer state, runs the layers (forward and, through autograd,
backward) under ``torch.autocast`` with bfloat16, and sends activations and gradients between
stages as bfloat16; the loss is computed in float32 from the logits. ``bf16`` stores the
weights (so gradients and optimizer state) in bfloat16 and feeds the first layer bfloat16
copies of floating-point inputs. Integer inputs (token ids) are never cast. One process
matches a job exactly only with the same casts at the stage boundaries, since autocast's
output dtypes depend on the op; against one process under autocast without them, losses agree
to bfloat16's precision (about 3 significant digits), which the tests allow for.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from pipesvc.core.config import JobConfig
from pipesvc.core.link_codecs import Codecs
from pipesvc.core.loss import compute_loss
from pipesvc.core.optim import build_optimizer
from pipesvc.core.tying import StageTies
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    StageOutOfMemoryError,
)
from pipesvc.models import model_features
from pipesvc.models.carry import Carry
from pipesvc.stage.compute.carried_vectors import CarriedVectors
from pipesvc.stage.compute.grad_buffers import GradBuffers
from pipesvc.stage.compute.layer_calls import LayerCalls
from pipesvc.stage.compute.layer_plan import build_chunks, settle_trainable
from pipesvc.stage.compute.out_of_memory import memory_exhausted, out_of_memory
from pipesvc.stage.compute.profiler import StageProfiler
from pipesvc.stage.compute.stage_state import (
    PreparedState,
    apply_state,
    held_tensors,
    prepare_state,
    state_tensors,
)
from pipesvc.stage.compute.tied_grads import TiedGrads
from pipesvc.stage.compute.weight_grads import WeightGradStore
from pipesvc.stage.compute.wire_casts import WireCasts, from_wire, to_wire


class StageRuntime:
    """Layers ``[start_layer, end_layer)`` of one job, their optimizer and in-flight state."""

    def __init__(
        self,
        *,
        config: JobConfig,
        start_layer: int,
        end_layer: int,
        rank: int,
        num_stages: int,
        device: torch.device,
        ties: StageTies | None = None,
        chunks: list[tuple[int, int]] | None = None,
        links: tuple[Codecs, Codecs] | None = None,
    ) -> None:
        self.config = config
        self.start_layer = start_layer
        self.end_layer = end_layer
        self.rank = rank
        self.num_stages = num_stages
        self.device = device
        self.chunks = chunks or [(start_layer, end_layer)]
        """The layer ranges this stage holds, chunk 0 first (see [Note: virtual stages])."""
        if self.chunks[0] != (start_layer, end_layer):
            raise InvalidArgumentError(
                f"chunk 0 holds layers {list(self.chunks[0])}; expected [{start_layer}, "
                f"{end_layer})"
            )
        if len(self.chunks) > 1 and ties is not None and ties.local:
            raise InvalidArgumentError(
                f"model {config.model!r} ties parameters across stages: virtual stages "
                "(several layer ranges per stage) do not support tied parameters"
            )
        # Per chunk, each layer's call plan, fixed at build time (see [Note: per-action cost]).
        chunk_layers = build_chunks(config, self.chunks, device)
        self._wire = WireCasts.of(config, links)
        self._calls = LayerCalls(
            chunk_layers,
            seed=config.seed,
            autocast=config.precision == "bf16-mixed",
            profile_wire=self._wire.profile_wire,
            rank=rank,
            ranges=self.chunks,
            device=device,
        )
        self._compute_dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
        # Keys "{global layer}.{param}", as build(...).state_dict() keys the whole model.
        self.module = nn.ModuleDict(
            {str(entry[0]): entry[1] for chunk in self._calls.chunks for entry in chunk}
        )
        self._training = True  # modules are built in training mode
        self.ties = settle_trainable(self.module, config, ties or StageTies(), self.chunks[0])
        self._tied = TiedGrads(self.ties)
        self.features = model_features(config.model, config.model_args)
        """The side inputs the model's layers read and its generation cache."""
        # Frozen parameters (LoRA's base weights, those ``trainable`` leaves out) get no
        # optimizer state; a stage with nothing to train (only a Flatten, or only frozen
        # layers) has no optimizer.
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(config.optimizer, params) if params else None
        self.step = 0
        self.peak_in_flight = 0
        self.profiler = StageProfiler()
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._carry = CarriedVectors(
            self.features.carry, model=config.model, chunks=self.chunks, device=device
        )
        # Micro-batches whose backward is split (see [Note: split backward] in core/action.py):
        # the weight gradients their B leaves for W, and B's seconds once it ran.
        self._deferred: dict[int, WeightGradStore] = {}
        self._backward_s: dict[int, float] = {}
        self._grads = GradBuffers()  # see [Note: gradient buffers]
        # A training run began and is not committed: its gradients replace the last step's.
        self._training_run = False
        self._microbatch_offset = 0
        """The step-wide index of this run's first micro-batch (see ``begin_run``)."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.num_stages - 1

    @property
    def live(self) -> int:
        """Micro-batches whose activations are held for a backward."""
        return len(self._saved)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def begin_run(self, training: bool, *, microbatch_offset: int = 0) -> None:
        """Starts a run; a training run clears the previous step's gradients. Its micro-batch
        ``i`` is micro-batch ``microbatch_offset + i`` of the step (a replica's share)."""
        self._microbatch_offset = microbatch_offset
        self._drop_run()
        self.peak_in_flight = 0
        if training:
            self._training_run = True
            self._grads.zero(self.module)

    def _drop_run(self) -> None:
        """Forgets what the run in flight keeps for its backward."""
        self._saved.clear()
        self._deferred.clear()
        self._backward_s.clear()
        self._carry.clear()

    def _set_mode(self, training: bool) -> None:
        """Training or eval mode for every layer (see [Note: train and eval mode])."""
        if training != self._training:
            self.module.train(training)
            self._training = training

    def first_virtual(self, chunk: int) -> bool:
        """Whether ``chunk`` here is the model's first virtual stage (it takes the inputs)."""
        return self.rank == 0 and chunk == 0

    def last_virtual(self, chunk: int) -> bool:
        """Whether ``chunk`` here is the model's last virtual stage (it computes the loss)."""
        return self.rank == self.num_stages - 1 and chunk == len(self.chunks) - 1

    @staticmethod
    def _key(microbatch: int, chunk: int) -> int:
        """Where a micro-batch's chunk keeps its activations (one key per pair)."""
        return chunk * _CHUNK_STRIDE + microbatch

    def forward(
        self,
        microbatch: int,
        x: torch.Tensor,
        *,
        training: bool,
        side: Mapping[str, torch.Tensor] | None = None,
        cache: Any = None,
        split_backward: bool = False,
        chunk: int = 0,
        carry: torch.Tensor | None = None,
        last_position: bool = False,
    ) -> torch.Tensor:
        """Runs this stage's layers of ``chunk`` on ``x`` (with the micro-batch's ``side``
        inputs, and in generation its key/value ``cache``); in training keeps what backward
        needs, for a backward in two passes with ``split_backward`` (see [Note: split
        backward] in ``pipesvc.core.action``). A training micro-batch of a model that carries
        a vector takes it in ``carry`` from the stage before (``carried`` gives the total to
        send on; see [Note: carried vector] in ``pipesvc.models.carry``). ``last_position``:
        an inference forward that needs only each row's last position from the model's last
        layers (see [Note: last position only] in ``pipesvc.stage.compute.layer_calls``).

        Raises:
            InvalidArgumentError: a side input the model does not read, or a layer failed.
            StageOutOfMemoryError: a layer ran out of memory (see [Note: stage out of memory]).
        """
        side = side or {}
        if side:
            unknown = sorted(set(side) - set(self.features.side_inputs))
            if unknown:
                raise InvalidArgumentError(
                    f"model {self.config.model!r} takes no side input {unknown[0]!r}; it "
                    f"takes {list(self.features.side_inputs) or 'none'}"
                )
        first = self.rank == 0 and chunk == 0
        if not first:
            x = from_wire(x, self._wire.up[0])
        x = x.to(self.device)
        if x.is_floating_point() and (self._wire.cast_always or x.dtype == self._wire.cast_from):
            x = x.to(self._compute_dtype)  # see [Note: wire dtype]
        if training != self._training:
            self._set_mode(training)
        last = self.last_virtual(chunk)
        if not training:
            with torch.no_grad():
                out = self._calls.apply(
                    x, chunk, side, cache=cache, last_position=last_position and last
                )
            return out if last else to_wire(out, self._wire.down[0])
        if not first:
            if not x.is_floating_point():
                raise InvalidArgumentError(
                    f"activation into layer {self.chunks[chunk][0]} has dtype {x.dtype}; "
                    "a floating-point tensor is needed for its gradient"
                )
            x = x.detach().requires_grad_(True)
        deferred = WeightGradStore() if split_backward else None
        start = self._carry.start(carry, first=first, chunk=chunk)
        holder = Carry(start) if start is not None else None
        y = self._calls.apply(
            x,
            chunk,
            side,
            step=self.step + 1,
            microbatch=self._microbatch_offset + microbatch,
            profiler=self.profiler,
            deferred=deferred,
            carry=holder,
        )
        key = self._key(microbatch, chunk)
        if start is not None and holder is not None:
            self._carry.keep(key, start, holder.value)
        if deferred is not None:
            self._deferred[key] = deferred
        self._saved[key] = (x, y)
        self.peak_in_flight = max(self.peak_in_flight, len(self._saved))
        return y if last else to_wire(y, self._wire.down[0])

    def carried(self, microbatch: int, chunk: int = 0) -> torch.Tensor | None:
        """The carried total of a training micro-batch's forward through ``chunk``, to send
        to the next stage; None when the model carries none."""
        return self._carry.total(self._key(microbatch, chunk))

    def carried_grad(self, microbatch: int, chunk: int = 0) -> torch.Tensor | None:
        """The gradient of the carried vector this stage started from, once ``backward`` of
        the micro-batch ran, to send to the stage before; None when the model carries none."""
        return self._carry.pop_grad(self._key(microbatch, chunk))

    def loss(self, microbatch: int, target: torch.Tensor, weight: float) -> torch.Tensor:
        """Last stage: the weighted loss of micro-batch ``microbatch`` (with the carried
        vector's term, when the model carries one), kept for backward."""
        key = self._key(microbatch, len(self.chunks) - 1)
        x, y = self._saved[key]
        try:  # as _memory_of_the_stage, without a generator per call
            logits = y.float() if y.is_floating_point() else y
            loss = compute_loss(self.config.loss, logits, target.to(self.device))
            loss = self._carry.with_loss(key, loss) * weight
        except (RuntimeError, MemoryError) as exc:
            if not out_of_memory(exc):
                raise
            raise self._memory_exhausted("the loss", exc) from exc
        self._saved[key] = (x, loss)
        return loss

    def backward(
        self,
        microbatch: int,
        grad_output: torch.Tensor | None,
        chunk: int = 0,
        carry_grad: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Backpropagates micro-batch ``microbatch`` through ``chunk``; returns the input's
        gradient (except on the first virtual stage).

        On the last virtual stage ``grad_output`` is None and the saved loss is the root.
        Elsewhere a model that carries a vector takes its total's gradient in ``carry_grad``
        (``carried_grad`` then gives the start's, see [Note: carried vector]).

        Raises:
            FailedPreconditionError: no forward is pending for this micro-batch.
            InvalidArgumentError: the gradient does not match the output's shape.
        """
        key = self._key(microbatch, chunk)
        if key not in self._saved or key in self._backward_s:
            raise FailedPreconditionError(
                f"backward of micro-batch {microbatch} (chunk {chunk}) before forward"
            )
        split = key in self._deferred
        first = self.rank == 0 and chunk == 0
        # A split backward's micro-batch stays in flight until its W.
        x, y = self._saved[key] if split else self._saved.pop(key)
        carried = self._carry.pop(key)
        started = time.perf_counter()
        if split:
            self._backward_s[key] = 0.0
        if not y.requires_grad and (carried is None or not carried[1].requires_grad):
            # Nothing before this point trains (a first stage whose layers are all frozen, as
            # the embedding under LoRA): there is no gradient to compute or send.
            if carried is not None and not first:  # no gradient reached it: zeros
                self._carry.keep_grad(key, carried[0])
            return None if first else to_wire(torch.zeros_like(x), self._wire.up[1])
        if grad_output is not None:
            grad_output = from_wire(grad_output, self._wire.down[1])
        if grad_output is not None and grad_output.shape != y.shape:
            raise InvalidArgumentError(
                f"gradient of shape {list(grad_output.shape)} for an output of shape "
                f"{list(y.shape)}"
            )
        try:  # as _memory_of_the_stage, without a generator and a message per call
            if carried is not None:
                last = self.last_virtual(chunk)
                self._carry.backward(y, grad_output, carried, carry_grad, chunk=chunk, last=last)
            elif grad_output is None:
                torch.autograd.backward(y)
            else:
                torch.autograd.backward(y, grad_output.to(device=self.device, dtype=y.dtype))
        except (RuntimeError, MemoryError) as exc:
            if not out_of_memory(exc):
                raise
            where = f"the backward of micro-batch {microbatch}"
            raise self._memory_exhausted(where, exc) from exc
        if split:
            self._backward_s[key] = time.perf_counter() - started
        else:
            self.profiler.backward(time.perf_counter() - started)
        if carried is not None and not first:
            self._carry.keep_grad(key, carried[0])
        return None if first or x.grad is None else to_wire(x.grad, self._wire.up[1])

    def backward_weight(self, microbatch: int, chunk: int = 0) -> None:
        """``W`` of a split backward: adds the weight gradients its ``B`` left to the
        parameters' gradients; the micro-batch is then done.

        Raises:
            FailedPreconditionError: ``B`` of this micro-batch has not run.
        """
        key = self._key(microbatch, chunk)
        if key not in self._backward_s:
            raise FailedPreconditionError(
                f"weight gradient of micro-batch {microbatch} before its backward"
            )
        seconds = self._backward_s.pop(key)
        del self._saved[key]
        started = time.perf_counter()
        with self._memory_of_the_stage(f"the weight gradients of micro-batch {microbatch}"):
            self._deferred.pop(key).apply()
        self.profiler.backward(seconds + time.perf_counter() - started)

    def _memory_exhausted(self, where: str, exc: BaseException) -> StageOutOfMemoryError:
        """The error of memory exhausted in ``where`` (see [Note: stage out of memory])."""
        return memory_exhausted(where, exc, rank=self.rank, chunks=self.chunks, device=self.device)

    @contextlib.contextmanager
    def _memory_of_the_stage(self, where: str) -> Iterator[None]:
        """Within it, running out of memory raises StageOutOfMemoryError."""
        try:
            yield
        except (RuntimeError, MemoryError) as exc:
            if not out_of_memory(exc):
                raise
            raise self._memory_exhausted(where, exc) from exc

    def settled_parameters(self) -> list[nn.Parameter]:
        """After a training run's last backward: the parameters that train, each with its
        gradient of the run or none if no backward reached it."""
        self._grads.settle()
        return [p for p in self.module.parameters() if p.requires_grad]

    def grad_norm_sq(self) -> float:
        """Sum over parameters of the squared gradient norm (for global clipping); a tied
        group counts once (see [Note: tied parameters] in ``pipesvc.core.tying``)."""
        self._grads.settle()
        total = 0.0
        for key, p in self.module.named_parameters():
            if p.grad is not None and key not in self.ties.out_of_norm:
                total += float(torch.linalg.vector_norm(p.grad)) ** 2
        return total

    def tied_partials(self) -> dict[int, torch.Tensor]:
        """After a training run's last backward: each tied group's gradient summed over its
        copies on this stage; returns those of the groups shared with another stage (to swap
        with it, then ``settle_ties``)."""
        self._grads.settle()
        return self._tied.partials(self.module)

    def settle_ties(self, theirs: dict[int, torch.Tensor]) -> None:
        """Gives every tied copy here its group's total (see ``TiedGrads.settle``).

        Raises:
            InvalidArgumentError: ``theirs`` lacks a shared group or does not match its shape.
        """
        self._tied.settle(self.module, theirs)

    def commit(self, grad_scale: float | None) -> int:
        """Applies the optimizer step (after scaling gradients); returns the step count.

        Raises:
            InvalidArgumentError: ``grad_scale`` is not a finite non-negative number.
        """
        self.apply_step(grad_scale)
        return self.count_step()

    def apply_step(self, grad_scale: float | None) -> None:
        """The optimizer step of ``commit`` (after scaling gradients), not yet counted.

        Raises:
            InvalidArgumentError: ``grad_scale`` is not a finite non-negative number (nothing
                changed).
        """
        self._grads.settle()
        if grad_scale is not None:
            if not (math.isfinite(grad_scale) and grad_scale >= 0):
                raise InvalidArgumentError(f"grad_scale ({grad_scale}) must be finite and >= 0")
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        if self.optimizer is not None:
            self.optimizer.step()

    def count_step(self) -> int:
        """Counts the step ``apply_step`` applied; returns the step count."""
        self.step += 1
        self._training_run = False
        return self.step

    def abort(self) -> None:
        """Drops the run's activations, and its gradients if it is an uncommitted training run;
        weights and optimizer are untouched (see [Note: gradients of the last committed step]).
        """
        self._drop_run()
        if self._training_run:
            self._training_run = False
            self._grads.forget()
            self.module.zero_grad(set_to_none=True)

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """The stage's tensors under global keys (see ``state_tensors``); ``"gradients"`` are
        those of the last committed step."""
        if kind == "gradients":
            self._grads.settle()
        return state_tensors(self.module, self.optimizer, kind)

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this runtime holds: weights and buffers, gradients, optimizer state and
        the activations of a run in flight (see ``storage_bytes``)."""
        saved = [t for pair in self._saved.values() for t in pair]
        return held_tensors(self.module, self.optimizer) + saved

    def release(self) -> None:
        """Drops every tensor this runtime holds (its job was replaced or released); the
        runtime computes nothing afterwards (see [Note: one copy while reassigned] in
        ``pipesvc.stage.assignment``)."""
        self._drop_run()
        self._grads.forget()
        self._tied.forget()
        self.optimizer = None
        self._calls.chunks = [[] for _ in self.chunks]
        self.module = nn.ModuleDict()

    def check_state(self, staged: dict[str, torch.Tensor], *, owned: bool = False) -> PreparedState:
        """Checks that ``staged`` is exactly this stage's state (see ``prepare_state``) and
        prepares it; changes nothing.

        Raises:
            InvalidArgumentError: missing or unexpected keys, or a shape or dtype mismatch.
        """
        return prepare_state(
            self.module, self.optimizer, (self.start_layer, self.end_layer), staged, owned=owned
        )

    def load_state(self, prepared: PreparedState, step: int | None = None) -> None:
        """Applies what ``check_state`` prepared; sets the step counter if ``step`` is given."""
        apply_state(self.module, self.optimizer, prepared)
        if step is not None:
            self.step = step


_CHUNK_STRIDE = 1 << 20
"""Keys of a micro-batch's chunks in flight: ``chunk * _CHUNK_STRIDE + microbatch`` (more
micro-batches than this are refused long before)."""
