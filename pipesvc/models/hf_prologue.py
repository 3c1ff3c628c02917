"""The body's prologue run once for every decoder block of one forward of a stage.

[Note: shared prologue] Each block runs the body's own code up to its call (see [Note: Hugging
Face layers] in ``hf.py``): masks and rotary tables, computed again by every block of a stage
from the same padding mask and positions (8.7% of a decode step's forward on the ~110M Llama).
Within one forward of a stage's layers (see [Note: forward scope] in
``pipesvc.models.forward_scope``) the first block runs the body once and keeps what it passes
to *every* later decoder layer (``arguments_for``); a later block on the same inputs takes its own,
so arguments that differ per layer (a layer type's mask or rotary table) are still exactly
what the body gives that layer. Only the cache view differs: each block's view answers with
its own cache layer (``_cache_view`` in ``hf.py``), so the first block's view is swapped for
this block's (``Prologue.arguments_of``). With a cache whose layers are of several kinds
(sliding and full attention, linear attention), the body sizes each kind's mask from a layer
of that kind, which the first block's view does not hold: such blocks run the body each for
itself, as before (``arguments_for`` is None).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipesvc.models import forward_scope, hf_body
from pipesvc.models.hf_skeleton import Skeleton

Arguments = tuple[tuple[Any, ...], dict[str, Any]]
"""What the body passes a decoder layer besides the hidden states."""


def one_kind(cache: Any) -> bool:
    """Whether every layer of ``cache`` is of one kind (no cache: trivially), so one view of
    it sizes every block's masks as the block's own view would."""
    layers = getattr(cache, "layers", None)
    return not isinstance(layers, list) or len({type(layer) for layer in layers}) <= 1


def swap(value: Any, old: Any, new: Any) -> Any:
    """``value`` with ``old`` replaced by ``new`` wherever it appears (in tuples, lists and
    dicts)."""
    if value is old:
        return new
    if type(value) is tuple or isinstance(value, list):
        return type(value)(swap(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: swap(v, old, new) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Prologue:
    """What one run of the body passed every decoder layer from one on, and the inputs it ran
    on (see [Note: shared prologue])."""

    mask: torch.Tensor | None
    positions: torch.Tensor | None
    """As the run was given them (None: counted from the cache)."""
    cache: Any
    shape: torch.Size
    dtype: torch.dtype
    view: Any
    """The cache view it ran with, in ``arguments`` wherever the body passed it on."""
    arguments: dict[int, Arguments]

    def fits(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        cache: Any,
    ) -> bool:
        return (
            self.mask is mask
            and self.positions is positions
            and self.cache is cache
            and self.shape == hidden.shape
            and self.dtype == hidden.dtype
        )

    def arguments_of(self, index: int, view: Any) -> Arguments:
        """Decoder layer ``index``'s arguments, with its own cache ``view``."""
        args, kwargs = self.arguments[index]
        if view is self.view:
            return args, kwargs
        swapped: Arguments = (swap(args, self.view, view), swap(kwargs, self.view, view))
        return swapped


def body_call(
    skeleton: Skeleton,
    body: nn.Module,
    hidden: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    view: Any,
) -> Callable[[], Any]:
    """A decoder layer's shell ``body`` called on its hidden states (detached: only what the
    body computes from positions and masks is kept), its padding mask, positions and cache
    view."""
    return functools.partial(
        body,
        inputs_embeds=hidden.detach(),
        attention_mask=mask,
        position_ids=positions.to(hidden.device) if positions is not None else None,
        use_cache=view is not None,
        **{skeleton.cache_arg: view},
        **skeleton.quiet,
    )


def _key(skeleton: Skeleton) -> tuple[str, int]:
    return ("hf prologue", id(skeleton))


def arguments_for(
    skeleton: Skeleton,
    index: int,
    shell: Callable[[], nn.Module],
    hidden: torch.Tensor,
    mask: torch.Tensor | None,
    given: torch.Tensor | None,
    positions: torch.Tensor | None,
    cache: Any,
    view: Any,
) -> Arguments | None:
    """Decoder layer ``index``'s arguments from this forward's prologue; None where blocks may
    not share one (no forward scope, or a cache of several kinds). If no prologue of this
    forward fits these inputs and holds this layer, runs the layer's ``shell`` once (the
    capture), keeping what it passes to this layer and every one after it. ``given``: the
    positions as the block got them; ``positions``: those it runs with."""
    scope = forward_scope.scope()
    if scope is None or not one_kind(cache):
        return None
    key = ("hf prologue", id(skeleton))
    found = scope.get(key)
    if (
        isinstance(found, Prologue)
        and found.fits(hidden, mask, given, cache)
        and index in found.arguments
    ):
        return found.arguments_of(index, view)
    last = len(skeleton.blocks) - 1
    arguments: dict[int, Arguments] = {}

    def keep(at: int, passed: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
        if at >= index:
            arguments[at] = (args, kwargs)
        if at == last:
            hf_body.stop(None)
        return passed

    hf_body.run(body_call(skeleton, shell(), hidden, mask, positions, view), keep)
    if index not in arguments:
        raise hf_body.not_reached(f"decoder layer {index}")
    scope[key] = Prologue(mask, given, cache, hidden.shape, hidden.dtype, view, arguments)
    return arguments[index]  # run with this layer's own view
