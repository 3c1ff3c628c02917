"""How a run calls a stage's layers: each chunk's layers in order with the side inputs, cache
and carried vector they read, a stochastic layer's training call under its seed, autocast and a
split backward's weight gradients only when on, and the profiler's samples (no gRPC here)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models import layer_rng
from pipesvc.models.carry import Carry
from pipesvc.models.forward_scope import forward_scope
from pipesvc.stage.compute.layer_plan import LayerCall, positionwise_tail
from pipesvc.stage.compute.out_of_memory import memory_exhausted, out_of_memory
from pipesvc.stage.compute.profiler import FlopCount, StageProfiler, output_bytes
from pipesvc.stage.compute.weight_grads import DeferWeightGrads, WeightGradStore

# [Note: last position only]
#
# A generation run needs, from the last stage, only each row's last position: its next token
# (or that token's logits). The layers at the end of a model that compute every position from
# that position alone (the final norm and the LM head: a layer class says so with
# ``positionwise = True``) then run on ``x[:, -1:]`` rather than on every position of a
# prompt, as ``transformers``' own ``generate`` does with ``logits_to_keep=1``. For a prompt of
# 16 tokens on the ~110M Llama that is the head's 16x fewer products over a 32000-word
# vocabulary. The caches are the blocks', before the tail, so they are unchanged; a run that
# returns every position (``Job.infer``) never asks for it.


class LayerCalls:
    """A stage's layers by chunk, each with its call plan (see ``build_chunks``), and how a
    run calls them."""

    def __init__(
        self,
        chunks: list[list[LayerCall]],
        *,
        seed: int,
        autocast: bool,
        profile_wire: str | None,
        rank: int,
        ranges: list[tuple[int, int]],
        device: torch.device,
    ) -> None:
        self.chunks = chunks
        """Per chunk, each layer's call plan (emptied when the job is released)."""
        self._seed = seed
        self._autocast = autocast
        self._profile_wire = profile_wire
        self._rank = rank
        self._ranges = ranges
        self._device = device

    def apply(
        self,
        x: torch.Tensor,
        chunk: int,
        side: Mapping[str, torch.Tensor],
        *,
        cache: Any = None,
        step: int = 0,
        microbatch: int | None = None,
        profiler: StageProfiler | None = None,
        deferred: WeightGradStore | None = None,
        carry: Carry | None = None,
        last_position: bool = False,
    ) -> torch.Tensor:
        """Runs the layers of ``chunk`` on ``x`` (see [Note: precision] in
        ``pipesvc.stage.compute.runtime``). A training call names its micro-batch's step-wide
        index (``microbatch``) and the ``step`` it computes: stochastic layers then run seeded,
        and ``profiler`` samples the layers. With ``deferred`` (a split backward), the linear
        layers' backward leaves their weight gradients there (see
        pipesvc.stage.compute.weight_grads). With ``last_position``, the chunk's positionwise
        layers at its end see only each row's last position (see [Note: last position only]).

        Raises:
            InvalidArgumentError: a layer failed on its input.
            StageOutOfMemoryError: a layer ran out of memory (see [Note: stage out of memory]).
        """
        # torch.autocast(enabled=False) costs a few µs per call and changes nothing here
        # (no caller runs a stage inside an autocast region), so it is entered only when on;
        # without either context the layers run directly (see [Note: per-action cost]).
        call = (x, chunk, side, cache, step, microbatch, profiler, carry, last_position)
        if deferred is None and not self._autocast:
            return self._call_layers(*call)
        defer = DeferWeightGrads(deferred) if deferred is not None else contextlib.nullcontext()
        cast = (
            torch.autocast(self._device.type, dtype=torch.bfloat16)
            if self._autocast
            else contextlib.nullcontext()
        )
        with cast, defer:
            return self._call_layers(*call)

    def _call_layers(
        self,
        x: torch.Tensor,
        chunk: int,
        side: Mapping[str, torch.Tensor],
        cache: Any,
        step: int,
        microbatch: int | None,
        profiler: StageProfiler | None,
        carry: Carry | None,
        last_position: bool,
    ) -> torch.Tensor:
        samples: list[tuple[int, float, int]] = []  # a training forward's, for the profiler
        # Moved once for every layer: the layers of one forward then read the same tensors
        # (see [Note: shared prologue] in pipesvc.models.hf_prologue).
        side = {n: t.to(self._device) for n, t in side.items()}
        calls = self.chunks[chunk]
        tail = positionwise_tail(calls) if last_position else len(calls)
        with forward_scope():  # see [Note: forward scope] in pipesvc.models.forward_scope
            for at, (index, layer, seeded, wanted, reads_cache, adds) in enumerate(calls):
                if at == tail and x.dim() > 1:
                    x = x[:, -1:]  # see [Note: last position only]
                # A layer names the side inputs it reads (``side_inputs``, see [Note: side inputs])
                # and whether it reads and extends a generation cache (``uses_cache``).
                kwargs: dict[str, Any] = {n: side[n] for n in wanted if n in side} if wanted else {}
                if cache is not None and reads_cache:
                    kwargs["cache"] = cache
                if carry is not None and adds:
                    kwargs["carry"] = carry
                started = time.perf_counter()
                try:
                    if profiler is not None and profiler.needs_flops(index):
                        counter = FlopCount()
                        with counter:
                            x = self._call_layer(layer, x, kwargs, seeded, step, microbatch, index)
                        profiler.counted(index, counter.total)
                    else:
                        x = self._call_layer(layer, x, kwargs, seeded, step, microbatch, index)
                except (RuntimeError, IndexError, ValueError, MemoryError) as exc:
                    if out_of_memory(exc):
                        where = f"the forward of layer {index}"
                        raise memory_exhausted(
                            where, exc, rank=self._rank, chunks=self._ranges, device=self._device
                        ) from exc
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
        step: int,
        microbatch: int | None,
        index: int,
    ) -> torch.Tensor:
        """One layer's call: a stochastic layer's training call under its seed (see [Note:
        training randomness]); any other call as it is, with no generator touched."""
        if seeded and microbatch is not None:
            with layer_rng(self._seed, step, microbatch, index, self._device):
                return layer(x, **kwargs)  # type: ignore[no-any-return]
        return layer(x, **kwargs)  # type: ignore[no-any-return]
