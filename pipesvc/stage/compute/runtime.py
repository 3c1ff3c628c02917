"""A stage's compute: its layers, optimizer, and the forward/backward/commit of one run.

This module owns no threads and no network; the stage service drives it.

[Note: activation ownership] ``forward`` keeps the input (with grad) and output of each
micro-batch until its ``backward``; the output tensor is handed to the sender as is and is never
modified in place, so it can be sent while compute goes on.

[Note: gradient buffers] A training run zeroes the previous step's gradients in place rather
than dropping them (``zero_grad(set_to_none=True)``) and allocating new ones in backward. On
glibc before 2.38 a freed block of exactly a tensor's size is too small for the next
``posix_memalign`` of that size (torch aligns CPU tensors to 64 bytes, and glibc asks for the
size plus the alignment), so dropped gradients would stay resident as holes beside their
replacements; reusing the buffers also spares the page faults of fresh memory. A parameter that
gets no gradient in a run still ends it with ``grad`` None, as after
``zero_grad(set_to_none=True)``, so the optimizer skips it: ``_settle_grads`` drops the buffers
that no backward has added to since they were zeroed (their version counter is unchanged). The
sums are those of fresh buffers, since ``0 + g`` is ``g``.

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

[Note: stage out of memory] Memory exhausted in a run's compute (a layer's forward, the loss,
a backward, a split backward's weight gradients) raises ``StageOutOfMemoryError``: the stage's
failure, never the ``InvalidArgumentError`` of a layer that refused its input. It is a final
error: the coordinator aborts the run everywhere and recovers nothing (the same plan would run
out again), so the job stays at its step. torch's CPU allocator raises a plain RuntimeError,
recognised by its text (``_out_of_memory``). An optimizer step that runs out is left as it was
(a stage fault, recovered from), since it may have updated some parameters.

[Note: wire dtype] ``JobConfig.wire_dtype`` sends activations and gradients between stages in
a codec of their own, per role (``JobConfig.wire_codecs``), under any precision: a stage encodes
its output (and, in backward, its input's gradient) before sending, and the receiver decodes
it. A float codec (bfloat16, float16) is a cast: the receiver casts an arriving activation back
to its compute dtype (float32, or bfloat16 under ``bf16``; under ``bf16-mixed`` autocast takes
it as it is) and a gradient to its output's dtype. A quantizing codec (int8, int4) sends every
tensor as a packed blob (see [Note: packed blob] in ``pipesvc.core.quant``) that the receiver
decodes to the dtype it was sent in. The numbers are those of one process that runs
``quant.through_wire(t, activations, gradients)`` on each boundary's activation (for a float
codec on both roles that is ``t.to(wire).to(compute)``, through which autograd casts the
gradient the same way). float16 keeps 10 bits of mantissa against bfloat16's 7 but only 5 of
exponent: gradients below about 6e-8 flush to zero (no loss scaling here).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipesvc.core import quant
from pipesvc.core.config import JobConfig
from pipesvc.core.link_codecs import Codecs
from pipesvc.core.loss import compute_loss
from pipesvc.core.optim import build_optimizer, trains
from pipesvc.core.tying import StageTies
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    StageOutOfMemoryError,
    WireFormatError,
)
from pipesvc.models import (
    batch_statistics,
    build_layers,
    layer_rng,
    model_export,
    model_features,
    tied_parameters,
    uses_rng,
)
from pipesvc.models.carry import Carry, check_carried
from pipesvc.stage.compute.profiler import FlopCount, StageProfiler, output_bytes
from pipesvc.stage.compute.weight_grads import DeferWeightGrads, WeightGradStore
from pipesvc.storage.checkpoint import OPTIM_PREFIX, group_by_layer

_LayerCall = tuple[int, nn.Module, bool, tuple[str, ...], bool, bool]
"""How one layer is called: its global index, the layer, whether its training call is seeded
(see [Note: training randomness]), the side inputs it reads, whether it reads a generation
cache and whether it adds to a carried vector (see [Note: carried vector] in
``pipesvc.models.carry``); fixed when the layer is built."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Prepared:
    """State checked by ``check_state``, ready to apply."""

    weights: dict[str, torch.Tensor]
    optim_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]]
    has_optim: bool


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
        self._chunk_layers: list[list[_LayerCall]] = []
        for a, b in self.chunks:
            built = build_layers(
                config.model,
                config.model_args,
                seed=config.seed,
                start_layer=a,
                end_layer=b,
                device=device,
            )
            if config.num_microbatches > 1:
                _refuse_batch_statistics(a, built, config.num_microbatches)
            if config.precision == "bf16":
                for layer in built:
                    layer.to(torch.bfloat16)
            self._chunk_layers.append(
                [
                    (
                        a + i,
                        layer,
                        uses_rng(layer),
                        tuple(getattr(layer, "side_inputs", ())),
                        bool(getattr(layer, "uses_cache", False)),
                        bool(getattr(layer, "adds_to_carry", False)),
                    )
                    for i, layer in enumerate(built)
                ]
            )
        self._layers = [entry for chunk in self._chunk_layers for entry in chunk]
        self._autocast = config.precision == "bf16-mixed"
        # The codecs of the links in and out (see [Note: codecs per link]); without a plan,
        # the job's on both.
        self._up, self._down = links or (config.wire_codecs, config.wire_codecs)
        act = self._up[0]
        # The float dtype activations arrive in, cast back on arrival (None: quantized or exact).
        self._wire_float: torch.dtype | None = (
            getattr(torch, act) if act is not None and act not in quant.CODE_BITS else None
        )
        self._compute_dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
        # What forward casts a floating-point input to the compute dtype for (see [Note: wire
        # dtype]): always (bf16 weights, or a quantized codec outside autocast), or only when it
        # arrives in the float codec's dtype (None: never).
        self._cast_always = config.precision == "bf16" or (
            act in quant.CODE_BITS and not self._autocast
        )
        self._cast_from: torch.dtype | None = None if self._autocast else self._wire_float
        # The codec activations leave in, for the profiler's bytes (a property that parses).
        self._profile_wire = config.wire_codecs[0]
        # Keys "{global layer}.{param}", as build(...).state_dict() keys the whole model.
        self.module = nn.ModuleDict({str(entry[0]): entry[1] for entry in self._layers})
        self._training = True  # modules are built in training mode
        ties = ties or StageTies()
        if not trains(config.optimizer):  # an inference job: no gradients, no state
            self.module.requires_grad_(False)
        elif config.trainable is not None:
            self._freeze_all_but(config.trainable, ties)
        params_by_key = dict(self.module.named_parameters())
        for keys in ties.local.values():
            missing = [k for k in keys if k not in params_by_key]
            if missing:
                raise InvalidArgumentError(
                    f"tied keys {missing} are not parameters of layers [{start_layer}, "
                    f"{end_layer}) of model {config.model!r}"
                )
        # Tied groups that train (a frozen group, as under LoRA, has no gradient to share).
        self.ties = StageTies(
            local={
                g: keys for g, keys in ties.local.items() if params_by_key[keys[0]].requires_grad
            },
            peers={
                g: peer
                for g, peer in ties.peers.items()
                if params_by_key[ties.local[g][0]].requires_grad
            },
            out_of_norm=ties.out_of_norm,
        )
        self._tied_partials: dict[int, torch.Tensor] = {}
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
        # A carried vector's start and total per micro-batch in flight, and the start's
        # gradient once its backward ran (see [Note: carried vector] in pipesvc.models.carry).
        self._carried: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._carried_grads: dict[int, torch.Tensor] = {}
        # Micro-batches whose backward is split (see [Note: split backward] in core/action.py):
        # the weight gradients their B leaves for W, and B's seconds once it ran.
        self._deferred: dict[int, WeightGradStore] = {}
        self._backward_s: dict[int, float] = {}
        # Gradient buffers zeroed for this run, with their version after zeroing (see Note).
        self._zeroed: list[tuple[torch.nn.Parameter, torch.Tensor, int]] = []
        # A training run began and is not committed: its gradients replace the last step's.
        self._training_run = False
        self._microbatch_offset = 0
        """The step-wide index of this run's first micro-batch (see ``begin_run``)."""

    def _freeze_all_but(self, patterns: tuple[str, ...], ties: StageTies) -> None:
        """Only parameters whose name (the model's own, as ``Job.state_dict()`` shows it)
        matches one of ``patterns`` keep training; a tied parameter trains if any name of its
        group matches (one parameter in one process), so every stage decides the same."""
        export = model_export(self.config.model, self.config.model_args)
        own = export.get("keys") if export else None
        names: dict[str, str] = own if isinstance(own, dict) else {}

        def matches(key: str) -> bool:
            return any(fnmatch.fnmatchcase(names.get(key, key), p) for p in patterns)

        group_of = {key: g for g, keys in ties.local.items() for key in keys}
        groups = tied_parameters(self.config.model, self.config.model_args)
        for key, param in self.module.named_parameters():
            keys = groups[group_of[key]] if key in group_of else (key,)
            if not any(matches(k) for k in keys):
                param.requires_grad_(False)

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
            self._zero_grads()

    def _drop_run(self) -> None:
        """Forgets what the run in flight keeps for its backward."""
        self._saved.clear()
        self._deferred.clear()
        self._backward_s.clear()
        self._carried.clear()
        self._carried_grads.clear()

    def _zero_grads(self) -> None:
        """Zeroes the gradient buffers in place for the run to accumulate into (see Note)."""
        self._zeroed = []
        for p in self.module.parameters():
            grad = p.grad
            if grad is None:
                continue
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
            grad.zero_()
            self._zeroed.append((p, grad, grad._version))

    def _settle_grads(self) -> None:
        """Drops the zeroed gradient buffers that no backward of the run accumulated into."""
        for p, grad, version in self._zeroed:
            if p.grad is grad and grad._version == version:
                p.grad = None
        self._zeroed = []

    def _set_mode(self, training: bool) -> None:
        """Training or eval mode for every layer (see [Note: train and eval mode])."""
        if training != self._training:
            self.module.train(training)
            self._training = training

    @staticmethod
    def _to_wire(t: torch.Tensor, codec: str | None) -> torch.Tensor:
        """What is sent to a neighbour with ``codec`` (see [Note: wire dtype])."""
        if codec is None:
            return t
        if codec in quant.CODE_BITS:
            return quant.to_blob(t.detach(), codec)  # every tensor: see [Note: packed blob]
        return t.detach().to(getattr(torch, codec)) if t.is_floating_point() else t

    @staticmethod
    def _from_wire(t: torch.Tensor, codec: str | None) -> torch.Tensor:
        """What a neighbour sent with ``codec``, as it stands (a quantized one decoded)."""
        if codec is None or codec not in quant.CODE_BITS:
            return t
        try:
            return quant.from_blob(t)
        except WireFormatError as exc:
            raise InvalidArgumentError(f"a tensor from a neighbour stage: {exc}") from exc

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

    def _apply(
        self,
        x: torch.Tensor,
        microbatch: int | None,
        side: Mapping[str, torch.Tensor],
        cache: Any = None,
        deferred: WeightGradStore | None = None,
        chunk: int = 0,
        carry: Carry | None = None,
    ) -> torch.Tensor:
        """Runs the layers (see [Note: precision]); in training, stochastic ones run seeded.
        With ``deferred`` (a split backward), the linear layers' backward leaves their weight
        gradients there (see pipesvc.stage.compute.weight_grads)."""
        # torch.autocast(enabled=False) costs a few µs per call and changes nothing here
        # (no caller runs a stage inside an autocast region), so it is entered only when on;
        # without either context the layers run directly (see [Note: per-action cost]).
        if deferred is None and not self._autocast:
            return self._apply_layers(x, microbatch, side, cache, chunk, carry)
        defer = DeferWeightGrads(deferred) if deferred is not None else contextlib.nullcontext()
        cast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self._autocast
            else contextlib.nullcontext()
        )
        with cast, defer:
            return self._apply_layers(x, microbatch, side, cache, chunk, carry)

    def _apply_layers(
        self,
        x: torch.Tensor,
        microbatch: int | None,
        side: Mapping[str, torch.Tensor],
        cache: Any,
        chunk: int = 0,
        carry: Carry | None = None,
    ) -> torch.Tensor:
        seed, step = self.config.seed, self.step + 1
        mb = None if microbatch is None else self._microbatch_offset + microbatch
        profiler = self.profiler if microbatch is not None else None
        samples: list[tuple[int, float, int]] = []  # a training forward's, for the profiler
        for index, layer, seeded, wanted, reads_cache, adds in self._chunk_layers[chunk]:
            # A layer names the side inputs it reads (``side_inputs``, see [Note: side inputs])
            # and whether it reads and extends a generation cache (``uses_cache``).
            kwargs: dict[str, Any] = (
                {n: side[n].to(self.device) for n in wanted if n in side} if wanted else {}
            )
            if cache is not None and reads_cache:
                kwargs["cache"] = cache
            if carry is not None and adds:
                kwargs["carry"] = carry
            started = time.perf_counter()
            try:
                if profiler is not None and profiler.needs_flops(index):
                    counter = FlopCount()
                    with counter:
                        x = self._call_layer(layer, x, kwargs, seeded, seed, step, mb, index)
                    profiler.counted(index, counter.total)
                else:
                    x = self._call_layer(layer, x, kwargs, seeded, seed, step, mb, index)
            except (RuntimeError, IndexError, ValueError, MemoryError) as exc:
                if _out_of_memory(exc):
                    raise self._memory_exhausted(f"the forward of layer {index}", exc) from exc
                raise InvalidArgumentError(
                    f"layer {index} failed on an input of shape {list(x.shape)} and dtype "
                    f"{x.dtype}: {exc}"
                ) from exc
            if profiler is not None:  # a training forward (see pipesvc.stage.compute.profiler)
                seconds = time.perf_counter() - started
                samples.append((index, seconds, output_bytes(x, self._profile_wire)))
        if profiler is not None:
            profiler.layers(samples)
        return x

    def _call_layer(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        kwargs: dict[str, Any],
        seeded: bool,
        seed: int,
        step: int,
        microbatch: int | None,
        index: int,
    ) -> torch.Tensor:
        """One layer's call: a stochastic layer's training call under its seed (see [Note:
        training randomness]); any other call as it is, with no generator touched."""
        if seeded and microbatch is not None:
            with layer_rng(seed, step, microbatch, index, self.device):
                return layer(x, **kwargs)  # type: ignore[no-any-return]
        return layer(x, **kwargs)  # type: ignore[no-any-return]

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
    ) -> torch.Tensor:
        """Runs this stage's layers of ``chunk`` on ``x`` (with the micro-batch's ``side``
        inputs, and in generation its key/value ``cache``); in training keeps what backward
        needs, for a backward in two passes with ``split_backward`` (see [Note: split
        backward] in ``pipesvc.core.action``). A training micro-batch of a model that carries
        a vector takes it in ``carry`` from the stage before (``carried`` gives the total to
        send on; see [Note: carried vector] in ``pipesvc.models.carry``).

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
            x = self._from_wire(x, self._up[0])
        x = x.to(self.device)
        if x.is_floating_point() and (self._cast_always or x.dtype == self._cast_from):
            x = x.to(self._compute_dtype)  # see [Note: wire dtype]
        if training != self._training:
            self._set_mode(training)
        last = self.last_virtual(chunk)
        if not training:
            with torch.no_grad():
                out = self._apply(x, None, side, cache, chunk=chunk)
            return out if last else self._to_wire(out, self._down[0])
        if not first:
            if not x.is_floating_point():
                raise InvalidArgumentError(
                    f"activation into layer {self.chunks[chunk][0]} has dtype {x.dtype}; "
                    "a floating-point tensor is needed for its gradient"
                )
            x = x.detach().requires_grad_(True)
        deferred = WeightGradStore() if split_backward else None
        start = self._carry_start(carry, first, chunk)
        holder = Carry(start) if start is not None else None
        y = self._apply(x, microbatch, side, deferred=deferred, chunk=chunk, carry=holder)
        key = self._key(microbatch, chunk)
        if start is not None and holder is not None:
            self._carried[key] = (start, holder.value)
        if deferred is not None:
            self._deferred[key] = deferred
        self._saved[key] = (x, y)
        self.peak_in_flight = max(self.peak_in_flight, len(self._saved))
        return y if last else self._to_wire(y, self._down[0])

    def _carry_start(
        self, carry: torch.Tensor | None, first: bool, chunk: int
    ) -> torch.Tensor | None:
        """A training micro-batch's carried vector as this stage's layers start from it: zeros
        on the first stage, else what the stage before sent, as a leaf for its gradient; None
        when the model carries none.

        Raises:
            InvalidArgumentError: no vector, or not one of the model's size, from the stage
                before.
        """
        spec = self.features.carry
        if spec is None:
            return None
        if first:
            return torch.zeros(spec.size, dtype=torch.float32, device=self.device)
        if carry is None:
            raise InvalidArgumentError(
                f"model {self.config.model!r} carries a vector of {spec.size} into layer "
                f"{self.chunks[chunk][0]}; none arrived"
            )
        check_carried(carry, spec, f"the carried vector into layer {self.chunks[chunk][0]}")
        return carry.to(self.device).detach().requires_grad_(True)

    def carried(self, microbatch: int, chunk: int = 0) -> torch.Tensor | None:
        """The carried total of a training micro-batch's forward through ``chunk``, to send
        to the next stage; None when the model carries none."""
        found = self._carried.get(self._key(microbatch, chunk))
        return None if found is None else found[1].detach()

    def carried_grad(self, microbatch: int, chunk: int = 0) -> torch.Tensor | None:
        """The gradient of the carried vector this stage started from, once ``backward`` of
        the micro-batch ran, to send to the stage before; None when the model carries none."""
        return self._carried_grads.pop(self._key(microbatch, chunk), None)

    def loss(self, microbatch: int, target: torch.Tensor, weight: float) -> torch.Tensor:
        """Last stage: the weighted loss of micro-batch ``microbatch`` (with the carried
        vector's term, when the model carries one), kept for backward."""
        key = self._key(microbatch, len(self.chunks) - 1)
        x, y = self._saved[key]
        carried = self._carried.get(key)
        spec = self.features.carry
        try:  # as _memory_of_the_stage, without a generator per call
            logits = y.float() if y.is_floating_point() else y
            loss = compute_loss(self.config.loss, logits, target.to(self.device))
            if carried is not None and spec is not None:
                loss = loss + spec.loss(carried[1])
            loss = loss * weight
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
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
        carried = self._carried.pop(key, None) if self._carried else None
        started = time.perf_counter()
        if split:
            self._backward_s[key] = 0.0
        if not y.requires_grad and (carried is None or not carried[1].requires_grad):
            # Nothing before this point trains (a first stage whose layers are all frozen, as
            # the embedding under LoRA): there is no gradient to compute or send.
            if carried is not None and not first:
                self._carried_grads[key] = torch.zeros_like(carried[0])
            return None if first else self._to_wire(torch.zeros_like(x), self._up[1])
        if grad_output is not None:
            grad_output = self._from_wire(grad_output, self._down[1])
        if grad_output is not None and grad_output.shape != y.shape:
            raise InvalidArgumentError(
                f"gradient of shape {list(grad_output.shape)} for an output of shape "
                f"{list(y.shape)}"
            )
        try:  # as _memory_of_the_stage, without a generator and a message per call
            if carried is not None:
                self._backward_carried(y, grad_output, carried, carry_grad, chunk)
            elif grad_output is None:
                torch.autograd.backward(y)
            else:
                torch.autograd.backward(y, grad_output.to(device=self.device, dtype=y.dtype))
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            where = f"the backward of micro-batch {microbatch}"
            raise self._memory_exhausted(where, exc) from exc
        if split:
            self._backward_s[key] = time.perf_counter() - started
        else:
            self.profiler.backward(time.perf_counter() - started)
        if carried is not None and not first:
            start = carried[0]
            found = start.grad
            self._carried_grads[key] = found if found is not None else torch.zeros_like(start)
        return None if first or x.grad is None else self._to_wire(x.grad, self._up[1])

    def _backward_carried(
        self,
        y: torch.Tensor,
        grad_output: torch.Tensor | None,
        carried: tuple[torch.Tensor, torch.Tensor],
        carry_grad: torch.Tensor | None,
        chunk: int,
    ) -> None:
        """Backward from the output and, before the last stage, from the carried total too
        (see [Note: carried vector] in ``pipesvc.models.carry``).

        Raises:
            InvalidArgumentError: the carried total's gradient is missing or malformed.
        """
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if y.requires_grad:
            roots.append(y)
            grads.append(
                None if grad_output is None else grad_output.to(device=self.device, dtype=y.dtype)
            )
        total = carried[1]
        spec = self.features.carry
        if not self.last_virtual(chunk) and total.requires_grad and spec is not None:
            if carry_grad is None:
                raise InvalidArgumentError(
                    f"no gradient arrived for the vector carried out of layer "
                    f"{self.chunks[chunk][1] - 1}"
                )
            check_carried(carry_grad, spec, "the carried vector's gradient")
            roots.append(total)
            grads.append(carry_grad.to(self.device))
        torch.autograd.backward(roots, grads)

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
        ranges = ", ".join(f"[{a}, {b})" for a, b in self.chunks)
        return StageOutOfMemoryError(
            f"rank {self.rank} (layers {ranges}) ran out of {self.device} memory in {where}: "
            f"{exc}; the run was aborted and nothing changed. Use smaller micro-batches (a "
            "smaller batch or a larger num_microbatches) or more stages, whose budgets "
            "partition='memory' counts"
        )

    @contextlib.contextmanager
    def _memory_of_the_stage(self, where: str) -> Iterator[None]:
        """Within it, running out of memory raises StageOutOfMemoryError."""
        try:
            yield
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            raise self._memory_exhausted(where, exc) from exc

    def settled_parameters(self) -> list[nn.Parameter]:
        """After a training run's last backward: the parameters that train, each with its
        gradient of the run or none if no backward reached it."""
        self._settle_grads()
        return [p for p in self.module.parameters() if p.requires_grad]

    def grad_norm_sq(self) -> float:
        """Sum over parameters of the squared gradient norm (for global clipping); a tied
        group counts once (see [Note: tied parameters] in ``pipesvc.core.tying``)."""
        self._settle_grads()
        total = 0.0
        for key, p in self.module.named_parameters():
            if p.grad is not None and key not in self.ties.out_of_norm:
                total += float(torch.linalg.vector_norm(p.grad)) ** 2
        return total

    def tied_partials(self) -> dict[int, torch.Tensor]:
        """After a training run's last backward: each tied group's gradient summed over its
        copies on this stage; returns those of the groups shared with another stage (to swap
        with it, then ``settle_ties``)."""
        self._settle_grads()
        params = dict(self.module.named_parameters())
        self._tied_partials = {}
        for group, keys in self.ties.local.items():
            grads = [params[k].grad for k in keys]
            partial = torch.zeros_like(params[keys[0]])
            for grad in grads:
                if grad is not None:
                    partial += grad
            self._tied_partials[group] = partial
        return {g: self._tied_partials[g] for g in self.ties.peers}

    def settle_ties(self, theirs: dict[int, torch.Tensor]) -> None:
        """Gives every tied copy here its group's total: this stage's partial plus the other
        stage's (``theirs``, for groups shared with one).

        Raises:
            InvalidArgumentError: ``theirs`` lacks a shared group or does not match its shape.
        """
        params = dict(self.module.named_parameters())
        for group, keys in self.ties.local.items():
            total = self._tied_partials[group]
            if group in self.ties.peers:
                other = theirs.get(group)
                if other is None or other.shape != total.shape:
                    raise InvalidArgumentError(
                        f"tied group {group}: expected a gradient of shape {list(total.shape)} "
                        f"from rank {self.ties.peers[group]}; got "
                        f"{None if other is None else list(other.shape)}"
                    )
                total = total + other.to(device=total.device, dtype=total.dtype)
            for key in keys:
                p = params[key]
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)
        self._tied_partials = {}

    def commit(self, grad_scale: float | None) -> int:
        """Applies the optimizer step (after scaling gradients); returns the step count.

        Raises:
            InvalidArgumentError: ``grad_scale`` is not a finite non-negative number.
        """
        self._settle_grads()
        if grad_scale is not None:
            if not (math.isfinite(grad_scale) and grad_scale >= 0):
                raise InvalidArgumentError(f"grad_scale ({grad_scale}) must be finite and >= 0")
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        if self.optimizer is not None:
            self.optimizer.step()
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
            self._zeroed = []
            self.module.zero_grad(set_to_none=True)

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """The stage's tensors under global keys.

        ``kind`` is ``"parameters"`` (the state_dict), ``"gradients"`` (of the last committed
        step) or ``"checkpoint"`` (the state_dict plus optimizer state, see OPTIM_PREFIX).
        """
        if kind == "gradients":
            self._settle_grads()
            return {
                name: p.grad.detach()
                for name, p in self.module.named_parameters()
                if p.grad is not None
            }
        result = {k: v.detach() for k, v in self.module.state_dict().items()}
        if kind == "checkpoint" and self.optimizer is not None:
            for name, p in self.module.named_parameters():
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        result[f"{OPTIM_PREFIX}{name}.{key}"] = value.detach()
            return dict(group_by_layer(result))
        return result

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this runtime holds: weights and buffers, gradients, optimizer state and
        the activations of a run in flight (see ``storage_bytes``)."""
        held = list(self.module.state_dict().values())
        held += [p.grad for p in self.module.parameters() if p.grad is not None]
        if self.optimizer is not None:
            for slots in self.optimizer.state.values():
                held += [v for v in slots.values() if isinstance(v, torch.Tensor)]
        for x, y in self._saved.values():
            held += [x, y]
        return held

    def release(self) -> None:
        """Drops every tensor this runtime holds (its job was replaced or released); the
        runtime computes nothing afterwards (see [Note: one copy while reassigned] in
        ``pipesvc.stage.assignment``)."""
        self._drop_run()
        self._zeroed = []
        self._tied_partials = {}
        self.optimizer = None
        self._chunk_layers = [[] for _ in self.chunks]
        self._layers = []
        self.module = nn.ModuleDict()

    def check_state(self, staged: dict[str, torch.Tensor], *, owned: bool = False) -> _Prepared:
        """Checks that ``staged`` is exactly this stage's state_dict (plus, optionally,
        optimizer state under OPTIM_PREFIX keys) and prepares it; changes nothing.

        ``owned``: the caller hands ``staged`` over (it was decoded for this call and is
        dropped after it), so its optimizer tensors already on the right device become the
        optimizer state as they are; a copy would hold that state twice while a recovery
        restores it, above the budget the plan counted.

        Raises:
            InvalidArgumentError: missing or unexpected keys, or a shape or dtype mismatch.
        """
        weights = {k: v for k, v in staged.items() if not k.startswith(OPTIM_PREFIX)}
        optim = {k[len(OPTIM_PREFIX) :]: v for k, v in staged.items() if k.startswith(OPTIM_PREFIX)}
        current = self.module.state_dict()
        missing = sorted(set(current) - set(weights))
        unexpected = sorted(set(weights) - set(current))
        if missing or unexpected:
            raise InvalidArgumentError(
                f"state for layers [{self.start_layer}, {self.end_layer}) is missing "
                f"{missing[:5]} and has unexpected {unexpected[:5]}"
            )
        for name, tensor in weights.items():
            if tensor.shape != current[name].shape or tensor.dtype != current[name].dtype:
                raise InvalidArgumentError(
                    f"state tensor {name} has shape {list(tensor.shape)} {tensor.dtype}; "
                    f"expected {list(current[name].shape)} {current[name].dtype}"
                )
        params = dict(self.module.named_parameters())
        optim_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for key, tensor in optim.items():
            name, _, slot = key.rpartition(".")
            if name not in params or self.optimizer is None:
                raise InvalidArgumentError(
                    f"optimizer state {OPTIM_PREFIX}{key} names no parameter of layers "
                    f"[{self.start_layer}, {self.end_layer})"
                )
            param = params[name]
            if tensor.dim() > 0 and (tensor.shape != param.shape or tensor.dtype != param.dtype):
                raise InvalidArgumentError(
                    f"optimizer state {OPTIM_PREFIX}{key} is {list(tensor.shape)} "
                    f"{tensor.dtype}; its parameter is {list(param.shape)} {param.dtype}"
                )
            if tensor.dim() == 0 and not tensor.is_floating_point():
                raise InvalidArgumentError(
                    f"optimizer state {OPTIM_PREFIX}{key} is a {tensor.dtype} scalar; "
                    "a floating-point one is expected"
                )
            # Scalars (Adam's step count) stay on the CPU, as torch keeps them.
            device = param.device if tensor.dim() > 0 else torch.device("cpu")
            optim_state.setdefault(param, {})[slot] = tensor.to(device, copy=not owned)
        return _Prepared(weights=weights, optim_state=optim_state, has_optim=bool(optim))

    def load_state(self, prepared: _Prepared, step: int | None = None) -> None:
        """Applies what ``check_state`` prepared; sets the step counter if ``step`` is given."""
        current = self.module.state_dict()
        weights, optim_state = prepared.weights, prepared.optim_state
        with torch.no_grad():
            for name, tensor in weights.items():
                current[name].copy_(tensor)
        if prepared.has_optim and self.optimizer is not None:
            self.optimizer.state.clear()
            for param, slots in optim_state.items():
                self.optimizer.state[param] = slots
        if step is not None:
            self.step = step


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the memory ``tensors`` hold, each storage once (views, tied parameters and a
    state_dict's aliases of parameters count once, and a view holds its whole storage)."""
    storages: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed allocation (see [Note: stage out of memory])."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    # torch's CPU allocator raises a plain RuntimeError (an enforce failure in alloc_cpu.cpp):
    # its text is the only mark it has.
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(
        exc
    )


_CHUNK_STRIDE = 1 << 20
"""Keys of a micro-batch's chunks in flight: ``chunk * _CHUNK_STRIDE + microbatch`` (more
micro-batches than this are refused long before)."""


def _refuse_batch_statistics(
    start_layer: int, layers: list[nn.Module], num_microbatches: int
) -> None:
    """Raises InvalidArgumentError if a layer computes statistics across its batch.

    Such a layer normalises each micro-batch with that micro-batch's statistics (and updates
    its running averages once per micro-batch), so training it over more than one micro-batch
    cannot equal one-process training on the whole batch.
    """
    for offset, layer in enumerate(layers):
        found = batch_statistics(layer)
        if found:
            raise InvalidArgumentError(
                f"layer {start_layer + offset} ({type(layer).__name__}) computes statistics "
                f"across the batch ({', '.join(found)}): with num_microbatches "
                f"({num_microbatches}) > 1 it would see micro-batches, not the batch, and "
                "training would differ from one-process training; use num_microbatches=1, "
                "or a per-sample normalisation (LayerNorm, GroupNorm)"
            )
