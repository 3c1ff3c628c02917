"""Running a part of a Hugging Face causal LM with the body's own code around it.

[Note: the body's own code] What a decoder layer needs besides the hidden states is computed
once by the model's body before its layer loop: positions, rotary tables (one per attention
kind in Gemma 3), the attention masks of each kind (causal, sliding window, chunked), scaled
embeddings, and whatever a family adds. Rather than re-implement that per family, a pipesvc
layer runs the body's own ``forward`` on a *shell*: a shallow copy of the body whose decoder
list is replaced by stubs and whose parts held by other layers are replaced by placeholders.

- The embedding layer runs the body on the token ids; the stub of decoder layer 0 stops the run
  and returns the hidden states it was given (embedding, learned positions, scaling, dropout:
  whatever the body does first).
- Decoder layer ``i`` runs the body on its hidden states (detached: only what the body computes
  from positions and masks is kept); stub ``i`` stops the run and returns the arguments the body
  passes to layer ``i``, with which the real layer is then called.
- The head runs the whole causal LM: stub 0 swaps in the real hidden states, the others pass
  them on, and the body's code after the loop (the final norm) and the causal LM's own code
  (the head, logit soft-capping or scaling) run as ``transformers`` wrote them.

Stubs forward attribute reads to the decoder layer they stand for (bodies read
``layer.attention_type``), placeholders to the part they stand for; a placeholder called
returns a zero scalar (GPT-2's body adds its position table to whatever it is given; the sum is
discarded by the stub). Which stub does what is per thread, for the duration of one call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from pipesvc.errors import InvalidArgumentError

Visitor = Callable[[int, torch.Tensor, tuple[Any, ...], dict[str, Any]], torch.Tensor]
"""Called by stub ``index`` with the hidden states and the other arguments the body gave it."""

_LOCAL = threading.local()


class _Stopped(Exception):  # control flow, not an error
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def stop(value: Any) -> NoReturn:
    """Ends the body's run from inside a visitor; ``run`` returns ``value``."""
    raise _Stopped(value)


class _StandIn(nn.Module):
    """A module in a shell standing for ``original``: attribute reads it does not answer
    itself go to ``original`` (kept outside its children, so nothing is registered twice)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_original", original)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)


class Stub(_StandIn):
    """Stands for decoder layer ``index`` inside a shell (see [Note: the body's own code])."""

    def __init__(self, index: int, original: nn.Module) -> None:
        super().__init__(original)
        self.index = index

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        visitor: Visitor = _LOCAL.visitor
        return visitor(self.index, hidden, args, kwargs)


class Absent(_StandIn):
    """Stands for a part another layer holds (its original is on the meta device); a call
    returns a zero scalar."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        return torch.zeros((), device=device)


def shell(original: nn.Module, modules: Mapping[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``original`` whose direct children are ``modules`` (by attribute name;
    every child of ``original`` must be given). Not a module of anything: callers keep it
    outside their own children so its parts are registered once, where they belong."""
    missing = set(original._modules) - set(modules)
    assert not missing, missing
    copy = object.__new__(type(original))
    copy.__dict__.update(original.__dict__)
    copy.__dict__["_modules"] = dict(modules)
    copy.__dict__["_parameters"] = {}
    copy.__dict__["_buffers"] = dict(original._buffers)
    return copy


def stubs(blocks: nn.ModuleList) -> nn.ModuleList:
    """One stub per decoder layer of ``blocks``."""
    return nn.ModuleList(Stub(i, block) for i, block in enumerate(blocks))


def run(call: Callable[[], Any], visitor: Visitor) -> Any:
    """Runs ``call`` (a shell's forward) with ``visitor`` answering the stubs; the value a
    visitor stopped the run with, else the call's own result."""
    previous = getattr(_LOCAL, "visitor", None)
    _LOCAL.visitor = visitor
    try:
        return call()
    except _Stopped as stopped:
        return stopped.value
    finally:
        _LOCAL.visitor = previous


def not_reached(what: str) -> InvalidArgumentError:
    """The error when a body's forward returned without calling the stub it needed."""
    return InvalidArgumentError(
        f"the model's body returned without calling its decoder layers for {what}; its "
        "forward does not fit (see [Note: the body's own code])"
    )
