"""How a stage's layers are built and which of them train: the call plan of each layer, the
trainable patterns and the tied groups (no gRPC here)."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from pipesvc.core.config import JobConfig
from pipesvc.core.optim import trains
from pipesvc.core.tying import StageTies
from pipesvc.errors import InvalidArgumentError
from pipesvc.models import batch_statistics, build_layers, model_export, tied_parameters, uses_rng

LayerCall = tuple[int, nn.Module, bool, tuple[str, ...], bool, bool]
"""How one layer is called: its global index, the layer, whether its training call is seeded
(see [Note: training randomness]), the side inputs it reads, whether it reads a generation
cache and whether it adds to a carried vector (see [Note: carried vector] in
``pipesvc.models.carry``); fixed when the layer is built."""


def positionwise_tail(chunk: list[LayerCall]) -> int:
    """Where the layers of ``chunk`` that each compute every position from that position alone
    (``positionwise``: a final norm and LM head) begin and run to its end: ``len(chunk)`` when
    its last layer is not one (see [Note: last position only] in
    ``pipesvc.stage.compute.layer_calls``)."""
    start = len(chunk)
    while start > 0 and getattr(chunk[start - 1][1], "positionwise", False):
        start -= 1
    return start


def build_chunks(
    config: JobConfig, chunks: list[tuple[int, int]], device: torch.device
) -> list[list[LayerCall]]:
    """The layers of each of ``chunks`` built on ``device``, each with its call plan.

    Raises:
        InvalidArgumentError: a layer computes batch statistics and the job has several
            micro-batches.
    """
    built_chunks: list[list[LayerCall]] = []
    for a, b in chunks:
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
        built_chunks.append(
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
    return built_chunks


def settle_trainable(
    module: nn.Module, config: JobConfig, ties: StageTies, layers: tuple[int, int]
) -> StageTies:
    """Freezes what does not train (everything for an inference job; what ``trainable`` leaves
    out) and returns the tied groups that still train (a frozen group, as under LoRA, has no
    gradient to share). ``layers``: the stage's range, for the errors.

    Raises:
        InvalidArgumentError: a tied key names no parameter of the stage.
    """
    if not trains(config.optimizer):  # an inference job: no gradients, no state
        module.requires_grad_(False)
    elif config.trainable is not None:
        _freeze_all_but(module, config, config.trainable, ties)
    params_by_key = dict(module.named_parameters())
    for keys in ties.local.values():
        missing = [k for k in keys if k not in params_by_key]
        if missing:
            raise InvalidArgumentError(
                f"tied keys {missing} are not parameters of layers [{layers[0]}, "
                f"{layers[1]}) of model {config.model!r}"
            )
    return StageTies(
        local={g: keys for g, keys in ties.local.items() if params_by_key[keys[0]].requires_grad},
        peers={
            g: peer
            for g, peer in ties.peers.items()
            if params_by_key[ties.local[g][0]].requires_grad
        },
        out_of_norm=ties.out_of_norm,
    )


def _freeze_all_but(
    module: nn.Module, config: JobConfig, patterns: tuple[str, ...], ties: StageTies
) -> None:
    """Only parameters whose name (the model's own, as ``Job.state_dict()`` shows it) matches
    one of ``patterns`` keep training; a tied parameter trains if any name of its group
    matches (one parameter in one process), so every stage decides the same."""
    export = model_export(config.model, config.model_args)
    own = export.get("keys") if export else None
    names: dict[str, str] = own if isinstance(own, dict) else {}

    def matches(key: str) -> bool:
        return any(fnmatch.fnmatchcase(names.get(key, key), p) for p in patterns)

    group_of = {key: g for g, keys in ties.local.items() for key in keys}
    groups = tied_parameters(config.model, config.model_args)
    for key, param in module.named_parameters():
        keys = groups[group_of[key]] if key in group_of else (key,)
        if not any(matches(k) for k in keys):
            param.requires_grad_(False)


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
