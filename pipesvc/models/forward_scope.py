"""One forward of a stage's layers on one micro-batch, as a scope its layers may share work in.

[Note: forward scope] Some layers compute the same thing from the same inputs: every Hugging
Face decoder block of a stage runs the body's prologue (masks, rotary tables) on the same
padding mask and positions (see [Note: shared prologue] in ``hf_prologue.py``). A stage runs each
micro-batch's layers inside ``forward_scope()``; a layer keeps what the others may reuse in
``scope()``, a dict that lives for that forward only, on that thread, so nothing it holds
outlives the forward or reaches another micro-batch. Outside a scope (a layer called on its
own, a recomputation in backward) ``scope()`` is None and each layer computes for itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_LOCAL = threading.local()


@contextlib.contextmanager
def forward_scope() -> Iterator[None]:
    """Runs the block as one forward of a stage's layers (see [Note: forward scope])."""
    previous = getattr(_LOCAL, "scope", None)
    _LOCAL.scope = {}
    try:
        yield
    finally:
        _LOCAL.scope = previous


def scope() -> dict[Any, Any] | None:
    """The current forward's shared dict; None outside a forward scope."""
    found: dict[Any, Any] | None = getattr(_LOCAL, "scope", None)
    return found
