"""A stage's generation sessions: the key/value caches of its own layers, per session and part.

[Note: generation sessions] A generation session (``Job.generate``) keeps, on every stage, the
keys and values its layers computed for the tokens so far, so each new token is one pass of one
position through the pipeline. The coordinator splits a session's rows into parts (micro-batches,
fixed for the session's life) and names each part's cache in the run request (``CacheRef``):
``fresh`` starts it empty (the prompt's prefill, or a replay of every token so far after a
stage was lost), otherwise the part must already have one here. The caches of a stage are
bounded by its KV budget: a run that leaves them above it fails with RESOURCE_EXHAUSTED, naming
the sizes. A session idle longer than the idle timeout is dropped by a timer of its own, between
runs (under the run lock); so is one the coordinator releases (the client finished or went
away), and every one of a job whose coordinator restarted (its sessions ended with the old one).
A new assignment (a new plan epoch) starts with no caches: the coordinator replays the
session's tokens to rebuild them. No gRPC here.

[Note: session runs] One session's expiry or failure never costs another session its cache. A
run first checks that every part it extends has a cache here; if not, it fails with
``SessionCacheLostError`` naming those sessions and changes nothing, and the coordinator
replays just them (``fresh``) in the same run as the others' next step. Other stages may have
run their part of that run already, and any run can fail midway (a budget, a neighbour): so a
stage notes the length of each part a run touches (``begin``), and a run that fails, or that
the coordinator aborts after it finished here, puts every part back as it was (``undo``: the
parts it extended cut back to their length, the ones it started dropped). Then every stage
holds each session as the coordinator believes, and the session's next step is the one it would
have been. A model without a ``CacheLayout`` cannot cut a cache back: its touched sessions are
dropped instead, and the coordinator replays each alone when a stage reports it lost.

[Note: cache memory] The KV budget bounds the memory the caches really keep alive: every
storage their tensors live in, counted once and whole (``held_bytes``), not each tensor's own
size. A tensor can be a view into a larger storage: a part cut from a fused run's stacked,
left-padded cache (all the run's rows, padded to the longest), or keys and values projected
together with the queries. A view would keep all of that alive, so a part keeps a copy of what
is its own (``compact``, in ``put`` and after each run), and a fused run's stacked cache lives
only for its run; then what is counted is what a session keeps. A model whose cache shows no
``CacheLayout`` cannot be copied this way; its storages are still counted whole.

[Note: kept stack] A fused decode run (see [Note: fused decode] in
``pipesvc.stage.compute.fused_cache``) stacks its parts' caches into one, left-padded, and the
next decode step of the same sessions would stack them again: two copies of every cache a step
(stack, then cut back), growing with the caches' length. So the parts of a fused run that
extended every part by the same positions stay stacked after it (``_Stack``), and the next run
of exactly those parts, in the same order, runs on that stack as it is. Anything else that
needs one of its parts alone (a run with other parts, a replay, a release, a prefix) first cuts
the stack back into each part's own cache (``_dissolve``), so a change of the sessions in the
step costs what every step cost before. Undoing a run cuts the stack back to its width before
the run: an append never writes the positions already there, so that is the stack as it was,
even after a run that failed between two layers. The stack is counted whole against the budget
(its padding too); a run over the budget first cuts it back into the parts' own caches. A
stack of parts of very different lengths is mostly padding (one 4000-position session beside
fifty of 10 positions: 44 times what the parts own, ``bench/kv_memory.py``), so a stack is kept
only while it holds at most ``KEEP_PADDING`` (2) times the positions of its parts, also after
an undo, which shortens its parts but not always its width.

[Note: prefix reuse] A prompt often starts as an earlier one did (a shared system prompt, the
previous turn of a chat). After a session's first run the coordinator may ask a stage to keep
a copy of the first positions of its cache under a name (``CacheRef.keep_as``), and a later
session to start its cache as a copy of the first positions of such a prefix
(``CacheRef.source``) instead of empty; then only the rest of its prompt runs through the
stages. Prefixes are one row each, kept in least-recently-used order, and counted in the KV
budget like sessions: a run that leaves the caches over the budget first drops the least
recently used prefixes, and fails only if the sessions alone are over it. A session whose
source is not here (dropped, or a new plan epoch) fails its run with
``SessionCacheLostError`` like a lost cache, so the coordinator replays it from its first
token. Only models with a ``CacheLayout`` (whose caches can be cut and copied) keep prefixes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipesvc.core.microbatch import CacheRef
from pipesvc.errors import (
    FailedPreconditionError,
    KVBudgetError,
    SessionCacheLostError,
)
from pipesvc.models import CacheLayout
from pipesvc.stage.compute import fused_cache

logger = logging.getLogger(__name__)

MIB = 2**20

KEEP_PADDING = 2.0
"""A fused run's stack is kept only while it holds at most this many times the positions its
parts own (see [Note: kept stack])."""


def _tensors(cache: Any) -> list[torch.Tensor]:
    """The key and value tensors a cache holds (its own ``tensors()``, or a ``transformers``
    cache's layers)."""
    own = getattr(cache, "tensors", None)
    if callable(own):
        return [t for pair in own().values() for t in pair]
    found: list[Any] = []
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            found += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    else:  # older transformers: one list per kind
        found += list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", []))
    return [t for t in found if isinstance(t, torch.Tensor)]


def held_bytes(caches: Iterable[Any]) -> int:
    """The bytes the caches really keep alive: every storage their tensors live in, each once
    and whole (see [Note: cache memory])."""
    storages: dict[tuple[str, int], int] = {}
    for cache in caches:
        for t in _tensors(cache):
            storage = t.untyped_storage()
            storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def cache_bytes(cache: Any) -> int:
    """The bytes one cache keeps alive (``held_bytes`` of it alone)."""
    return held_bytes([cache])


def compact(cache: Any, layout: CacheLayout | None) -> Any:
    """``cache``, or with ``layout`` a copy whose tensors own exactly their bytes when any of
    them is a view into a larger storage (a cut of a fused run's stacked cache, or keys and
    values projected together with the queries)."""
    if layout is None:
        return cache
    tensors = layout.tensors(cache)
    if all(_owns(t) for pair in tensors.values() for t in pair):
        return cache
    return layout.build({name: (_own_copy(k), _own_copy(v)) for name, (k, v) in tensors.items()})


def _length(cache: Any, layout: CacheLayout | None) -> int | None:
    """The positions ``cache`` holds, or None where its layout is unknown."""
    if layout is None:
        return None
    return max((k.shape[2] for k, _ in layout.tensors(cache).values()), default=0)


def _copy(cache: Any, length: int, layout: CacheLayout) -> Any:
    """A new cache holding copies of ``cache``'s first ``length`` positions."""
    return layout.build(
        {
            name: (k[:, :, :length].clone(), v[:, :, :length].clone())
            for name, (k, v) in layout.tensors(cache).items()
        }
    )


def _cut_back(cache: Any, length: int, layout: CacheLayout) -> Any:
    """``cache`` holding only its first ``length`` positions (copies: see ``compact``)."""
    if all(k.shape[2] == length for k, _ in layout.tensors(cache).values()):
        return cache
    return _copy(cache, length, layout)


def expiry_interval(idle_s: float) -> float:
    """How often the expiry timer looks for idle sessions: a quarter of the idle timeout (a
    session goes at most a quarter late), within [0.05, 30] seconds."""
    return min(max(idle_s / 4, 0.05), 30.0)


class ExpiryTimer:
    """Calls ``expire`` every ``interval_s`` on a thread of its own until ``stop``."""

    def __init__(self, expire: Callable[[], object], interval_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(expire, interval_s), name="session-expiry", daemon=True
        )
        self._thread.start()

    def _loop(self, expire: Callable[[], object], interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                expire()
            except Exception:  # the next tick tries again; the stage serves on
                logger.exception("expiring idle generation sessions failed")

    def stop(self) -> None:
        self._stop.set()


def _owns(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    return t if _owns(t) else t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True, slots=True)
class _Stack:
    """The parts of the last fused run, kept stacked (see [Note: kept stack])."""

    keys: tuple[tuple[str, int], ...]
    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    """Each part's positions now (the stack is as wide as the longest)."""
    cache: Any
    index: dict[tuple[str, int], int] = field(init=False, repr=False, compare=False)
    """Each part's place in ``keys``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {key: i for i, key in enumerate(self.keys)})

    @property
    def mostly_padding(self) -> bool:
        """Whether it holds more than ``KEEP_PADDING`` times the positions its parts own."""
        owned = sum(r * n for r, n in zip(self.rows, self.lengths, strict=True))
        return sum(self.rows) * max(self.lengths) > KEEP_PADDING * owned

    def cut(self, layout: CacheLayout) -> list[Any]:
        """Each part's own cache (copies)."""
        zero = (0,) * len(self.keys)
        return fused_cache.StackedCaches(
            layout, self.cache, self.rows, self.lengths, zero, max(self.lengths)
        ).split()


class SessionCaches:
    """The caches of one job's sessions on one stage (see [Note: generation sessions])."""

    def __init__(
        self,
        new_cache: Callable[[], Any] | None,
        *,
        budget_bytes: int,
        layout: CacheLayout | None = None,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._new_cache = new_cache
        self._layout = layout
        self._budget = budget_bytes
        self._idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._caches: dict[tuple[str, int], Any] = {}
        self._used: dict[str, float] = {}
        self._undo: tuple[int, dict[tuple[str, int], int | None]] | None = None
        """The last run begun here, and each part's length before it (None: drop it)."""
        self._prefixes: OrderedDict[str, Any] = OrderedDict()
        """Kept prefixes by name, least recently used first (see [Note: prefix reuse])."""
        self._stack: _Stack | None = None
        """The last fused run's parts, kept stacked; not in ``_caches`` (see [Note: kept
        stack])."""

    def begin(self, run_id: int, refs: Iterable[CacheRef]) -> None:
        """Before run ``run_id`` reads and extends the caches of ``refs`` (none: a run without
        caches): checks that every part it extends is here, and notes each part's length for
        ``undo`` (see [Note: session runs]).

        Raises:
            SessionCacheLostError: parts the run extends have no cache here (nothing changed).
        """
        refs = list(refs)
        with self._lock:
            # A part may come again in later micro-batches (a chunked prefill): its first
            # reference says whether it must be here already, and what to undo.
            first: dict[tuple[str, int], CacheRef] = {}
            for r in refs:
                first.setdefault((r.session, r.part), r)
            refs = list(first.values())
            lost = sorted(
                {r.session for r in refs if not r.fresh and not self._holds((r.session, r.part))}
                | {r.session for r in refs if r.source and not self._source_fits(r)}
            )
            if lost:
                raise SessionCacheLostError(
                    f"session(s) {', '.join(map(repr, lost))} have no cache on this stage "
                    "(expired, released or never started); replay them",
                    lost,
                )
            self._undo = (
                run_id,
                {
                    (r.session, r.part): None if r.fresh else self._length_of((r.session, r.part))
                    for r in refs
                },
            )

    def _holds(self, key: tuple[str, int]) -> bool:
        return key in self._caches or (self._stack is not None and key in self._stack.index)

    def _length_of(self, key: tuple[str, int]) -> int | None:
        """The positions part ``key`` holds (it is here; under the lock)."""
        if self._stack is not None and key in self._stack.index:
            return self._stack.lengths[self._stack.index[key]]
        return _length(self._caches[key], self._layout)

    def _dissolve(self) -> None:
        """Cuts the kept stack back into each part's own cache (under the lock)."""
        kept, self._stack = self._stack, None
        if kept is not None:
            assert self._layout is not None  # only a layout stacks
            self._caches.update(zip(kept.keys, kept.cut(self._layout), strict=True))

    def _dissolve_holding(self, keys: Iterable[tuple[str, int]]) -> None:
        """``_dissolve`` if the kept stack holds any of ``keys`` (under the lock)."""
        if self._stack is not None and not set(keys).isdisjoint(self._stack.keys):
            self._dissolve()

    def _source_fits(self, ref: CacheRef) -> bool:
        """Whether ``ref``'s source prefix is here with at least the positions it starts from
        (under the lock)."""
        found = self._prefixes.get(ref.source)
        if found is None or self._layout is None:
            return False
        held = self._layout.tensors(found)
        # A stage whose layers keep no keys and values (an embedding or a head alone) keeps
        # empty caches: its copy of a prefix has no positions to fall short of.
        return not held or max(k.shape[2] for k, _ in held.values()) >= ref.source_positions

    def keep(self, refs: Iterable[CacheRef]) -> None:
        """After a run: keeps the prefixes ``refs`` ask for (see [Note: prefix reuse])."""
        if self._layout is None:
            return
        with self._lock:
            self._dissolve_holding((r.session, r.part) for r in refs if r.keep_as)
            for ref in refs:
                cache = self._caches.get((ref.session, ref.part)) if ref.keep_as else None
                if cache is not None:
                    self._prefixes[ref.keep_as] = _copy(cache, ref.keep_positions, self._layout)
                    self._prefixes.move_to_end(ref.keep_as)

    def prefixes(self) -> list[str]:
        """The kept prefixes' names, least recently used first."""
        with self._lock:
            return list(self._prefixes)

    def undo(self, run_id: int) -> None:
        """Puts the caches run ``run_id`` touched back as they were before it, if it is the
        last run begun here and not undone yet (see [Note: session runs])."""
        with self._lock:
            if self._undo is None or self._undo[0] != run_id:
                return
            lengths, self._undo = self._undo[1], None
            kept = self._stack
            if kept is not None and not set(lengths).isdisjoint(kept.keys):
                self._stack = self._stack_before(kept, lengths)
                if self._stack.mostly_padding:  # shorter parts weigh more padding than kept
                    self._dissolve()
            dropped = set()
            for key, length in lengths.items():
                cache = self._caches.get(key)
                if cache is None:
                    continue
                if length is None or self._layout is None:
                    dropped.add(key[0])
                else:
                    self._caches[key] = _cut_back(cache, length, self._layout)
            for key in [k for k in self._caches if k[0] in dropped]:
                del self._caches[key]
            for session in dropped:
                self._used.pop(session, None)

    def _stack_before(self, kept: _Stack, lengths: dict[tuple[str, int], int | None]) -> _Stack:
        """The kept stack as it was before the run that noted ``lengths`` (see [Note: kept
        stack]): the run extended every part of it, so each had a length then."""
        assert self._layout is not None
        before = tuple(
            length if (length := lengths.get(key)) is not None else now
            for key, now in zip(kept.keys, kept.lengths, strict=True)
        )
        width = max(before)
        tensors = self._layout.tensors(kept.cache)
        cache = self._layout.build(
            {name: (k[:, :, :width], v[:, :, :width]) for name, (k, v) in tensors.items()}
        )
        return _Stack(kept.keys, kept.rows, before, cache)

    def fused(self, refs: Sequence[CacheRef]) -> fused_cache.StackedCaches:
        """The stacked cache of a micro-batch fusing ``refs``' parts (see [Note: fused decode]
        in ``pipesvc.stage.compute.fused_cache``): the kept stack when it holds exactly these
        parts, in this order, and the run extends each (see [Note: kept stack]), otherwise a
        new stack of their caches.

        Raises:
            FailedPreconditionError, SessionCacheLostError: as ``get``.
            InvalidArgumentError: as ``fused_cache.stack``.
        """
        if self._layout is None:
            raise FailedPreconditionError("this model's caches cannot be stacked")
        keys = tuple((r.session, r.part) for r in refs)
        rows = tuple(r.rows for r in refs)
        positions = tuple(r.positions for r in refs)
        with self._lock:
            kept = self._stack
            if (
                kept is not None
                and (kept.keys, kept.rows) == (keys, rows)
                and not any(r.fresh for r in refs)
            ):
                now = self._clock()
                for ref in refs:
                    self._used[ref.session] = now
                return fused_cache.StackedCaches(
                    self._layout, kept.cache, rows, kept.lengths, positions, max(kept.lengths)
                )
        return fused_cache.stack(self._layout, [self.get(ref) for ref in refs], rows, positions)

    def fused_done(self, refs: Sequence[CacheRef], stacked: fused_cache.StackedCaches) -> None:
        """After a fused micro-batch ran on ``stacked``: keeps it stacked when the run extended
        every part by the same positions (see [Note: kept stack]), else puts each part's own
        cache back.

        Raises:
            InvalidArgumentError: as ``StackedCaches.split``.
        """
        keys = tuple((r.session, r.part) for r in refs)
        added = set(stacked.positions)
        assert self._layout is not None  # ``fused`` made it
        widths = {k.shape[2] for k, _ in self._layout.tensors(stacked.cache).values()}
        grown = min(added)
        kept = _Stack(keys, stacked.rows, tuple(n + grown for n in stacked.lengths), stacked.cache)
        if (
            len(added) > 1
            or any(r.fresh for r in refs)
            or len(set(keys)) != len(keys)
            or not widths <= {stacked.longest + grown}  # none: no layer here caches
            or kept.mostly_padding
        ):
            for ref, part in zip(refs, stacked.split(), strict=True):
                self.put(ref, part)
            return
        with self._lock:
            if self._stack is not None and self._stack.cache is not stacked.cache:
                self._dissolve()
            for key in keys:
                self._caches.pop(key, None)
            self._stack = kept
            now = self._clock()
            for ref in refs:
                self._used[ref.session] = now

    def get(self, ref: CacheRef) -> Any:
        """The cache of ``ref`` (an empty one when ``ref.fresh``).

        Raises:
            FailedPreconditionError: the model has no cache.
            SessionCacheLostError: the part has none here (never started, expired or released).
        """
        if self._new_cache is None:
            raise FailedPreconditionError("this model has no key/value cache to generate with")
        key = (ref.session, ref.part)
        with self._lock:
            self._dissolve_holding([key])
            if ref.fresh and ref.source and self._layout is not None:
                if not self._source_fits(ref):
                    raise SessionCacheLostError(
                        f"session {ref.session!r} starts from prefix {ref.source!r}, which "
                        "this stage does not keep; replay it",
                        [ref.session],
                    )
                self._prefixes.move_to_end(ref.source)
                source = self._prefixes[ref.source]
                self._caches[key] = _copy(source, ref.source_positions, self._layout)
            elif ref.fresh:
                self._caches[key] = self._new_cache()
            elif key not in self._caches:
                raise SessionCacheLostError(
                    f"session {ref.session!r} part {ref.part} has no cache on this stage "
                    "(expired, released or never started); replay it",
                    [ref.session],
                )
            self._used[ref.session] = self._clock()
            return self._caches[key]

    def put(self, ref: CacheRef, cache: Any) -> None:
        """Replaces the cache of ``ref``'s part (after a fused run cut it back, see [Note: fused
        decode] in ``pipesvc.stage.compute.fused_cache``), copying what it keeps if it is a view
        (see [Note: cache memory])."""
        kept = compact(cache, self._layout)
        with self._lock:
            self._dissolve_holding([(ref.session, ref.part)])
            self._caches[(ref.session, ref.part)] = kept
            self._used[ref.session] = self._clock()

    def session_bytes(self, session: str) -> int:
        """The bytes of ``session``'s caches; of the kept stack, its rows' share."""
        with self._lock:
            caches = [c for (s, _), c in self._caches.items() if s == session]
            kept = self._stack
        own = held_bytes(caches)
        if kept is None:
            return own
        rows = sum(r for (s, _), r in zip(kept.keys, kept.rows, strict=True) if s == session)
        return own + held_bytes([kept.cache]) * rows // sum(kept.rows)

    def total_bytes(self) -> int:
        """The bytes every cache here keeps alive, kept prefixes included (see [Note: cache
        memory])."""
        with self._lock:
            caches = list(self._caches.values()) + list(self._prefixes.values())
            if self._stack is not None:
                caches.append(self._stack.cache)
        return held_bytes(caches)

    def sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._used)

    def settle(self, sessions: Iterable[str]) -> None:
        """After a run that extended ``sessions``: enforces the budget.

        Raises:
            KVBudgetError: the caches exceed the budget (the caller undoes the run).
        """
        touched = set(sessions)
        with self._lock:  # a view into a larger storage would keep all of it alive
            for key, cache in self._caches.items():
                if key[0] in touched:
                    self._caches[key] = compact(cache, self._layout)
        total = self.total_bytes()
        while total > self._budget:  # the least recently used prefixes go first
            with self._lock:
                if not self._prefixes:
                    break
                name, _ = self._prefixes.popitem(last=False)
            logger.info("prefix %s dropped: the KV budget is full", name)
            total = self.total_bytes()
        if total > self._budget and self._stack is not None:  # its padding counts too
            with self._lock:
                self._dissolve()
            total = self.total_bytes()
        if total <= self._budget:
            return
        sizes = {s: self.session_bytes(s) for s in sorted(touched)}
        with self._lock:
            others = [c for (s, _), c in self._caches.items() if s not in touched]
            if self._stack is not None:
                others.append(self._stack.cache)
            count = len(set(self._used) - touched)
        raise KVBudgetError(
            f"key/value caches would hold {total / MIB:.2f} MiB on this stage, over its budget "
            f"of {self._budget / MIB:.2f} MiB (--kv-budget); the run's session(s) "
            + ", ".join(f"{s!r} ({b / MIB:.2f} MiB)" for s, b in sizes.items())
            + f"; {count} other session(s) hold {held_bytes(others) / MIB:.2f} MiB"
        )

    def release(self, session: str) -> int:
        """Drops every part of ``session``, or the kept prefix of that name; returns the bytes
        freed (0 if it had none)."""
        with self._lock:
            if self._stack is not None and any(k[0] == session for k in self._stack.keys):
                self._dissolve()
            keys = [k for k in self._caches if k[0] == session]
            dropped = [self._caches.pop(k) for k in keys]
            self._used.pop(session, None)
            prefix = self._prefixes.pop(session, None)
        return held_bytes(dropped + ([prefix] if prefix is not None else []))

    def release_all(self) -> int:
        """Drops every session's caches (a restarted coordinator's orphans); returns the bytes
        freed."""
        with self._lock:
            dropped = list(self._caches.values()) + list(self._prefixes.values())
            if self._stack is not None:
                dropped.append(self._stack.cache)
            self._stack = None
            count = len(self._used)
            self._caches.clear()
            self._used.clear()
            self._prefixes.clear()
        freed = held_bytes(dropped)
        if count:
            logger.info("%d orphaned session(s) released (%.2f MiB freed)", count, freed / MIB)
        return freed

    def expire(self) -> list[str]:
        """Drops the sessions idle for longer than the idle timeout; returns them."""
        now = self._clock()
        with self._lock:
            idle = [s for s, used in self._used.items() if now - used > self._idle_s]
        for session in idle:
            freed = self.release(session)
            logger.info(
                "session %s expired after %.0f s idle (%.2f MiB freed)",
                session,
                self._idle_s,
                freed / MIB,
            )
        return idle

    def clear(self) -> None:
        with self._lock:
            self._stack = None
            self._caches.clear()
            self._used.clear()
            self._prefixes.clear()
            self._undo = None
