"""The meta-device skeleton of a Hugging Face causal LM that every pipesvc layer's shells copy.

A layer runs the body's own code on a shell of this skeleton (see [Note: the body's own code] in
``hf_body.py``); ``Skeleton.check`` refuses at registration a body that cannot be cut between
its decoder layers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError
from pipesvc.models import hf_body
from pipesvc.models.hf_checkpoint import MODELS_KEPT, checkpoint_of, part_of
from pipesvc.models.hf_family import Family


class Skeleton:
    """The meta-device model a layer's shells copy (see [Note: the body's own code] in
    ``hf_body.py``): shared by every layer of a model, never copied with one."""

    def __init__(self, model: nn.Module, family: Family) -> None:
        self.model = model
        self.family = family
        self.body: nn.Module = part_of(model, family.body)
        self.blocks: nn.ModuleList = part_of(model, family.blocks)
        self.list_name = family.blocks.rpartition(".")[2]
        params = inspect.signature(self.body.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        # The shells never record router logits: the blocks tap their own routers (see [Note:
        # the router's auxiliary loss] in hf_router.py), and the whole model's forward would
        # compute its auxiliary loss from the none a shell records.
        self.quiet: dict[str, Any] = (
            {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}
        )
        # Stateless (which stub does what is per call and thread): made once, not per call.
        self._stubs = hf_body.stubs(self.blocks)
        self._absent = {
            name: hf_body.Absent(child)
            for owner in (self.body, self.model)
            for name, child in owner.named_children()
        }

    def __deepcopy__(self, memo: dict[int, Any]) -> Skeleton:
        return self

    def check(self) -> None:
        """Runs the body's code on zeros to see that it passes each layer's output on to the
        next layer unchanged (hidden states in, hidden states out), which cutting it between
        layers needs; a body that unpacks its layers' outputs (falcon's ``outputs[0]``) does
        not fit.

        Raises:
            InvalidArgumentError: the body does not fit, with what it did.
        """
        width = getattr(self.model.config, "hidden_size", None)
        if not isinstance(width, int):
            return  # nothing to build zeros from: the per-family tests are the check
        zeros = torch.zeros(1, 2, width)
        seen: list[tuple[int, tuple[int, ...]]] = []

        def visit(index: int, hidden: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
            seen.append((index, tuple(hidden.shape)))
            return hidden

        body = self.body_shell({}, shared=True)
        # What runs after the last layer (absent here) may fail on the placeholders' zeros: the
        # layers' calls, recorded before, are what this checks.
        with torch.no_grad(), contextlib.suppress(RuntimeError, IndexError, TypeError, ValueError):
            call = functools.partial(body, inputs_embeds=zeros, use_cache=False, **self.quiet)
            hf_body.run(call, visit)
        wanted = [(i, (1, 2, width)) for i in range(len(self.blocks))]
        if seen != wanted:
            kind = type(self.model).__name__
            raise InvalidArgumentError(
                f"{kind} does not fit: its body must pass each decoder layer's output to the "
                f"next one unchanged ([1, 2, {width}] to every layer); the layers were called "
                f"with {seen[:4]}{' ...' if len(seen) > 4 else ''} (a body that unpacks its "
                "layers' outputs cannot be cut between them)"
            )

    def body_shell(self, own: Mapping[str, nn.Module], *, shared: bool = False) -> nn.Module:
        """The body with the decoder list as stubs, ``own``'s parts real, the rest absent
        (``shared``: the skeleton's own modules without parameters, not copies)."""
        modules: dict[str, nn.Module] = {}
        for name, child in self.body.named_children():
            if name == self.list_name:
                modules[name] = self._stubs
            elif name in own:
                modules[name] = own[name]
            elif shared and f"{self.family.body}.{name}" in self.family.shared:
                modules[name] = child
            else:
                modules[name] = self._absent[name]
        return hf_body.shell(self.body, modules)

    def model_shell(self, own: Mapping[str, nn.Module], head: nn.Module) -> nn.Module:
        """The whole causal LM around ``body_shell(own)``, with ``head`` as its head."""
        modules: dict[str, nn.Module] = {}
        for name in self.model._modules:
            if name == self.family.body:
                modules[name] = self.body_shell(own)
            elif name == self.family.head:
                modules[name] = head
            else:
                modules[name] = self._absent[name]
        return hf_body.shell(self.model, modules)


@functools.lru_cache(maxsize=MODELS_KEPT)
def skeleton_of(directory: str) -> Skeleton:
    """The skeleton of the model in ``directory`` (a resolved path), built once per process."""
    ckpt = checkpoint_of(directory)
    return Skeleton(ckpt.meta_model, ckpt.family)
