"""Training randomness: which layers draw random numbers, and the seed each layer call gets.

[Note: training randomness] In a training run, every call of a layer that draws random numbers
(dropout and the like, see ``uses_rng``) runs under torch's global generators seeded from
``dropout_seed(seed, step, microbatch, layer)``: the job's seed, the number the step gets when
it commits (1 for a job's first step), the micro-batch's index in the step and the global
layer index. The masks therefore depend on nothing else: not on the partition, the schedule,
the stage, the thread, or the other micro-batches, so recovery's replay of step ``s`` (after
restoring an earlier checkpoint, possibly on a different plan) draws the masks of the first
attempt, and a one-process reference that wraps each layer call in ``layer_rng`` (or uses
``seeded_forward``) draws them too. The generators' previous state is restored after the call,
so nothing else sees the seeding. Backward draws nothing: autograd keeps the masks that forward
drew. Outside training (``module.eval()``) dropout draws nothing and no seeding is done.

The global generators are process-wide, so the seeded call holds ``RNG_LOCK``, as building a
layer from its init seed does: neither may see the other's draws.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm

USES_RNG_ATTR = "uses_rng"
"""A module whose ``uses_rng`` attribute is True draws random numbers in training (a model marks
its own stochastic code with it; torch's dropout modules are recognised without it)."""

RNG_LOCK = threading.RLock()
"""Held while torch's global generators are seeded for one purpose (a layer's init, a layer's
training call); other threads must not draw from them meanwhile."""


def dropout_seed(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The seed of layer ``layer``'s training call on micro-batch ``microbatch`` of step
    ``step`` (1 for a job's first step) of a job seeded ``seed``: a stable hash in [0, 2**63).

    It is the same in every process, platform and run, and unrelated to the layer's init seed.
    """
    text = f"pipesvc.dropout:{seed}:{step}:{microbatch}:{layer}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _is_stochastic(module: nn.Module) -> bool:
    if getattr(module, USES_RNG_ATTR, False) is True:
        return True
    if isinstance(module, _DropoutNd):
        return bool(module.p > 0)
    if isinstance(module, nn.MultiheadAttention):
        return bool(module.dropout > 0)
    if isinstance(module, nn.RReLU):
        return bool(module.lower != module.upper)
    return False


def uses_rng(layer: nn.Module) -> bool:
    """Whether ``layer`` (or a module inside it) draws random numbers in training mode: a
    dropout module with ``p > 0``, ``MultiheadAttention`` with dropout, ``RReLU``, or a module
    marked with a true ``uses_rng`` attribute."""
    return any(_is_stochastic(sub) for sub in layer.modules())


def batch_statistics(layer: nn.Module) -> list[str]:
    """Names and types of the modules inside ``layer`` whose results depend on the batch they
    are given: BatchNorm of any kind (it normalises with the batch's statistics in training
    and updates running averages once per call) and InstanceNorm that tracks running
    statistics (updated once per call). Such a layer sees micro-batches, not the batch, so
    pipelined training with more than one micro-batch differs from one-process training."""
    found = []
    for name, sub in layer.named_modules():
        if isinstance(sub, _BatchNorm) or (
            isinstance(sub, _InstanceNorm) and sub.track_running_stats
        ):
            found.append(f"{name or '(the layer)'}: {type(sub).__name__}")
    return found


@contextlib.contextmanager
def layer_rng(
    seed: int,
    step: int,
    microbatch: int,
    layer: int,
    device: torch.device | str | None = None,
) -> Iterator[None]:
    """Seeds torch's CPU generator (and ``device``'s, if it is an accelerator) with
    ``dropout_seed(seed, step, microbatch, layer)`` for the body, then restores them.

    A one-process reference that runs layer ``layer`` inside this context draws the same
    dropout masks as the pipelined job's stage does for that call (on the same kind of device).
    """
    value = dropout_seed(seed, step, microbatch, layer)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    with RNG_LOCK:
        if dev.type == "cpu":
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(value)
                yield
            return
        backend = torch.get_device_module(dev.type)
        index = dev.index if dev.index is not None else backend.current_device()
        with torch.random.fork_rng(devices=[index], device_type=dev.type):
            torch.default_generator.manual_seed(value)
            with backend.device(index):
                backend.manual_seed(value)
            yield


def seeded_forward(
    layers: Iterable[nn.Module],
    x: torch.Tensor,
    *,
    seed: int,
    step: int,
    microbatch: int,
    first_layer: int = 0,
) -> torch.Tensor:
    """Runs ``layers`` (numbered from ``first_layer``) on ``x`` as a pipelined job's training
    run does: each layer under ``layer_rng``. With a model built by ``build(name, seed=seed)``
    in training mode, and ``x`` the job's micro-batch ``microbatch`` of step ``step``, the
    output and the dropout masks are the job's."""
    for offset, layer in enumerate(layers):
        with layer_rng(seed, step, microbatch, first_layer + offset, x.device):
            x = layer(x)
    return x
