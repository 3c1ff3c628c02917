"""Memory running out on a stage, told apart from a layer that refuses its input (no gRPC
here).

[Note: stage out of memory] Memory exhausted in a run's compute (a layer's forward, the loss,
a backward, a split backward's weight gradients) raises ``StageOutOfMemoryError``: the stage's
failure, never the ``InvalidArgumentError`` of a layer that refused its input. It is a final
error: the coordinator aborts the run everywhere and recovers nothing (the same plan would run
out again), so the job stays at its step. torch's CPU allocator raises a plain RuntimeError,
recognised by its text (``out_of_memory``). An optimizer step that runs out is left as it was
(a stage fault, recovered from), since it may have updated some parameters.
"""

from __future__ import annotations

import torch

from pipesvc.errors import StageOutOfMemoryError


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed allocation (see [Note: stage out of memory])."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    # torch's CPU allocator raises a plain RuntimeError (an enforce failure in alloc_cpu.cpp):
    # its text is the only mark it has.
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(
        exc
    )


def memory_exhausted(
    where: str,
    exc: BaseException,
    *,
    rank: int,
    chunks: list[tuple[int, int]],
    device: torch.device,
) -> StageOutOfMemoryError:
    """The error of memory exhausted in ``where`` on the stage of ``rank`` holding ``chunks``
    (see [Note: stage out of memory])."""
    ranges = ", ".join(f"[{a}, {b})" for a, b in chunks)
    return StageOutOfMemoryError(
        f"rank {rank} (layers {ranges}) ran out of {device} memory in {where}: "
        f"{exc}; the run was aborted and nothing changed. Use smaller micro-batches (a "
        "smaller batch or a larger num_microbatches) or more stages, whose budgets "
        "partition='memory' counts"
    )
