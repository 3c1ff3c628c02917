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

Memory freed by a stage stays in its heap for the next tensors until the process exits or the
heap's top grows past the trim threshold. Reuse only works if freed blocks can merge, which on
glibc before 2.38 needs the tunables of [Note: stage malloc tunables] below; with both, the
largest stage of ``bench/memory.py`` peaks at 1122 MiB, against 1283 MiB with neither.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from collections.abc import Mapping, Sequence

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
DEFAULT_THRESHOLD_BYTES = 1 << 30
"""Allocations below this come from the heap; the freed heap top above it is trimmed."""


_GIVEN_BY = {
    _M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    _M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
    _M_ARENA_MAX: ("MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
}
"""Each setting's environment variable and tunable, with which an operator sets it."""


def _given(option: int, environ: Mapping[str, str]) -> bool:
    variable, tunable = _GIVEN_BY[option]
    return bool(environ.get(variable)) or tunable in environ.get("GLIBC_TUNABLES", "")


def _mallopt(settings: Sequence[tuple[int, int]], environ: Mapping[str, str] | None = None) -> bool:
    """Applies ``settings`` (option, value) but those the process's environment (``environ``,
    default ``os.environ``) already gives glibc: a setting given as ``MALLOC_ARENA_MAX`` or
    ``MALLOC_MMAP_THRESHOLD_``, say, or through ``GLIBC_TUNABLES``, is the operator's and stays.
    A stage started with ``MALLOC_MMAP_THRESHOLD_=1048576`` so maps every tensor of 1 MiB or
    more on its own, and its resident memory is what it holds, at a cost to speed
    (``tests/integration/test_reassign_memory.py`` measures a stage so). Returns False where
    there is no glibc or it refused a setting."""
    env = os.environ if environ is None else environ
    return _apply([(option, value) for option, value in settings if not _given(option, env)])


def _apply(settings: Sequence[tuple[int, int]]) -> bool:
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    refused = [(option, value) for option, value in settings if not mallopt(option, value)]
    if refused:
        logger.debug("mallopt refused %s", refused)
    return not refused


def tune_malloc(
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES, environ: Mapping[str, str] | None = None
) -> bool:
    """A stage's settings: glibc's mmap and trim thresholds, and one arena for all threads,
    but those ``environ`` gives (see ``_mallopt``); returns False where there is no glibc."""
    settings = [
        (_M_MMAP_THRESHOLD, threshold_bytes),
        (_M_TRIM_THRESHOLD, threshold_bytes),
        (_M_ARENA_MAX, 1),
    ]
    return _mallopt(settings, environ)


def single_arena(environ: Mapping[str, str] | None = None) -> bool:
    """The coordinator's setting: one malloc arena for all threads, unless ``environ`` gives
    it (see ``_mallopt``). It relays checkpoints in 1 MiB frames on many gRPC threads, and each
    thread's own arena keeps what it once held (measured on ``bench/memory.py``'s save: a peak
    of 293 MiB, 272 MiB with one arena)."""
    return _mallopt([(_M_ARENA_MAX, 1)], environ)


STAGE_GLIBC_TUNABLES = "glibc.malloc.tcache_count=0"
"""glibc tunables a stage process starts with (see ``stage_environ``)."""


def give_back() -> bool:
    """Hands the heap's free memory back to the system (glibc's ``malloc_trim(0)``, which
    also releases free pages inside the heap, not only at its top), after a job's tensors
    were dropped: with the high trim threshold above nothing else would, and the next job's
    tensors, allocated in another order, may not fit the freed blocks and grow the heap beside
    them (two copies' worth of resident memory through a reassign). Returns False where there
    is no glibc."""
    gc.collect()  # the dropped job's reference cycles, before its memory is given back
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim(0)
    return True


def stage_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to start a stage process in: ``environ`` (default ``os.environ``) with
    ``STAGE_GLIBC_TUNABLES`` added to ``GLIBC_TUNABLES``, unless that already sets them.

    [Note: stage malloc tunables] torch allocates every CPU tensor with ``posix_memalign`` (64-byte
    alignment). glibc before 2.38 serves that from a block of the size plus the alignment and
    frees the small leftovers on either side; freed small blocks go to the thread's cache
    (tcache), where they count as in use, so when the tensor is freed its block cannot merge with
    free neighbours, and alone it is too small for the next tensor of the same size. Every
    temporary of backward and of the optimizer step (Adam makes two per parameter) can so leave
    a resident hole of its size: with 48 x Linear(2048, 2048) and Adam over 4 stages (``python
    bench/memory.py``) the largest stage peaked at 1.25-1.35 GiB instead of ~1.13 GiB. Without
    the tcache the leftovers go to glibc's fastbins, which are merged before any large
    allocation, and the holes are reused. glibc reads tunables only when a process starts:
    ``LocalCluster`` starts stages with this environment, and ``pipesvc stage`` started any other
    way re-executes itself with it (``reexec_with_tunables``); other C libraries ignore it.
    """
    env = dict(os.environ if environ is None else environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count" not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, STAGE_GLIBC_TUNABLES) if t)
    return env


def reexec_with_tunables(argv: Sequence[str]) -> None:
    """Replaces this process with ``python -m pipesvc *argv`` under ``stage_environ()`` when
    glibc is the C library and the tunables are missing (the pid stays the same); otherwise
    returns at once. Call before anything else happens in the process."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    if not libc.startswith("glibc"):
        return
    env = stage_environ()
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "pipesvc", *argv], env)
