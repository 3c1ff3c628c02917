"""Process-wide malloc settings for stage servers (no gRPC here).

glibc serves every allocation above its mmap threshold (at most 32 MiB however it adapts) with
a fresh ``mmap``, and gives it back with ``munmap`` when freed. A stage allocates a new tensor
for every activation or gradient it receives, so each large one costs page faults and zeroing
of every page, every time: a 64 MiB tensor arrives at about a fifth of the speed of a copy into
memory the process already has. Raising the threshold keeps those buffers in the heap, where
the next tensor of the same size reuses the same pages; raising the trim threshold with it
stops glibc from handing the freed top of the heap back after each step. Threads share the
main arena (``M_ARENA_MAX`` 1): a thread's own arena is made of 64 MiB heaps, so a tensor
received on a reader thread that is larger than that would be mapped afresh every time anyway.

Peak resident memory is unchanged in the common case (the pages are reused rather than
re-faulted); memory freed by a stage stays in its heap until the process exits or the heap's top
grows past the trim threshold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
DEFAULT_THRESHOLD_BYTES = 1 << 30
"""Allocations below this come from the heap; the freed heap top above it is trimmed."""


def tune_malloc(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """Sets glibc's mmap and trim thresholds; returns False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    done = bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes)) and done
    done = bool(mallopt(_M_ARENA_MAX, 1)) and done
    if not done:
        logger.debug("mallopt refused a threshold of %d bytes", threshold_bytes)
    return done
