"""A stage's session caches under long random sequences of what the engine does to them,
checked against a plain model of each session's positions (see [Note: kept stack] and
[Note: session runs] in pipesvc.stage.compute.sessions).

Each step of a sequence is one of: a fused decode run of some sessions in some order (it
finishes, fails after some of its layers, finishes and is aborted, or finishes over the KV
budget), a run of one session alone (which extends the session's own cache in place), a
release, or a look at one session alone. After every step each live session must hold
exactly its own positions, the bytes counted must be at least those positions and at most
what the padding bound allows, and a released session must hold nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from pipesvc.core.microbatch import CacheRef
from pipesvc.errors import ResourceExhaustedError
from pipesvc.models.gpt import KVCache
from pipesvc.models.registry import CacheLayout
from pipesvc.stage.compute.sessions import KEEP_PADDING, SessionCaches

LAYOUT = CacheLayout(tensors=KVCache.tensors, build=KVCache.from_tensors)
LAYERS = 2
HEADS = 2
WIDTH = 3
BYTES_PER_POSITION_ROW = LAYERS * 2 * HEADS * WIDTH * 4
"""Keys and values of every layer, float32."""


def _column(rows: int, value: float) -> torch.Tensor:
    return torch.full((rows, HEADS, 1, WIDTH), value)


def _start(rows: int, values: list[float]) -> KVCache:
    """A session's first cache: one position per value, the same in every layer (offset by
    the layer, so that layers cannot be swapped unnoticed)."""
    store = {}
    for layer in range(LAYERS):
        k = torch.cat([_column(rows, v + 1000 * layer) for v in values], 2)
        store[layer] = (k, k + 0.5)
    return KVCache.from_tensors(store)


def _append(cache: KVCache, value: float, layers: int = LAYERS) -> None:
    """What a forward does to a cache: each layer appends one position (a new tensor, as
    ``torch.cat`` makes)."""
    store = cache._store
    for layer in range(layers):
        k, v = store[layer]
        column = _column(k.shape[0], value + 1000 * layer)
        store[layer] = (torch.cat([k, column], 2), torch.cat([v, column + 0.5], 2))


class _Model:
    """Each live session's rows and the values of its positions, in order."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.values: dict[str, list[float]] = {}
        self.prefixes: dict[str, list[float]] = {}
        """Kept prefixes (one row each) the stage may still hold."""

    def prefix_bytes(self, caches: SessionCaches) -> int:
        """Of the prefixes the stage still holds (the budget may have dropped some)."""
        held = set(caches.prefixes())
        for name in set(self.prefixes) - held:
            del self.prefixes[name]
        return sum(len(v) * BYTES_PER_POSITION_ROW for v in self.prefixes.values())

    def check(self, caches: SessionCaches) -> None:
        assert caches.sessions() == sorted(self.values)
        own = 0
        for session, values in self.values.items():
            rows = self.rows[session]
            got = LAYOUT.tensors(caches.get(CacheRef(session, 0, False, rows, 1)))
            want = LAYOUT.tensors(_start(rows, values))
            assert got.keys() == want.keys(), session
            for layer in want:
                for g, w in zip(got[layer], want[layer], strict=True):
                    torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{session} {layer}")
            own += rows * len(values) * BYTES_PER_POSITION_ROW
        # ``get`` above cut any kept stack back: what is counted now is exactly what is owned.
        assert caches.total_bytes() == own + self.prefix_bytes(caches)

    def bound(self, caches: SessionCaches) -> None:
        """Between steps (a stack may be kept): counted bytes cover what is owned, and a
        kept stack's padding stays within its bound. An undone run leaves the stack a view of
        its storage one position wider (the next run's append replaces it), so one position
        of every row is allowed on top."""
        own = sum(self.rows[s] * len(v) * BYTES_PER_POSITION_ROW for s, v in self.values.items())
        own += self.prefix_bytes(caches)
        rows = sum(self.rows.values())
        total = caches.total_bytes()
        assert own <= total <= own * KEEP_PADDING + rows * BYTES_PER_POSITION_ROW, (own, total)


def _sequence(seed: int, steps: int, budget: int) -> None:
    rng = random.Random(seed)
    caches = SessionCaches(KVCache, budget_bytes=budget, layout=LAYOUT, idle_s=3600)
    model = _Model()
    run_id = 0
    value = 0.0
    names = iter(f"s{i}" for i in range(10_000))

    def fresh_session() -> None:
        nonlocal run_id, value
        session, rows = next(names), rng.choice((1, 2))
        model.prefix_bytes(caches)  # forget the prefixes the budget dropped
        source = rng.choice(sorted(model.prefixes)) if model.prefixes and rng.random() < 0.5 else ""
        values = (
            model.prefixes[source][: rng.randint(1, len(model.prefixes[source]))] if source else []
        )
        start = len(values)
        for _ in range(rng.randint(1, 6)):
            value += 1
            values.append(value)
        run_id += 1
        if source:
            rows = 1  # prefixes are one row
        ref = CacheRef(session, 0, True, rows, len(values), source=source, source_positions=start)
        caches.begin(run_id, [ref])
        if source:  # the stage copies the prefix's first positions, the prompt's rest runs
            cache = caches.get(ref)
            for v in values[start:]:
                _append(cache, v)
        else:
            caches.put(ref, _start(rows, values))
        try:
            caches.settle([session])
        except ResourceExhaustedError:
            caches.undo(run_id)
            return
        model.rows[session], model.values[session] = rows, values

    for _ in range(3):
        fresh_session()
    for _ in range(steps):
        live = sorted(model.values)
        kind = rng.choices(
            ("fused", "alone", "start", "release", "look"), weights=(10, 2, 1, 1, 1)
        )[0]
        if kind == "start" or not live:
            if len(live) < 8:
                fresh_session()
        elif kind == "release":
            session = rng.choice(live)
            assert caches.release(session) > 0
            del model.values[session], model.rows[session]
            assert caches.session_bytes(session) == 0
        elif kind == "look":
            model.check(caches)
        elif kind == "alone":
            session = rng.choice(live)
            rows = model.rows[session]
            run_id += 1
            value += 1
            keep = rows == 1 and rng.random() < 0.5  # the stage keeps a prefix of it
            length = len(model.values[session]) + 1
            kept = rng.randint(1, length) if keep else 0
            name = f"p{run_id}" if keep else ""
            ref = CacheRef(session, 0, False, rows, 1, keep_as=name, keep_positions=kept)
            caches.begin(run_id, [ref])
            outcome = rng.choice(("done", "failed", "aborted"))
            _append(caches.get(ref), value, layers=1 if outcome == "failed" else LAYERS)
            if outcome == "done":
                try:
                    caches.keep([ref])
                    caches.settle([session])
                except ResourceExhaustedError:
                    caches.undo(run_id)
                else:
                    model.values[session].append(value)
                    if keep:
                        model.prefixes[name] = model.values[session][:kept]
            else:
                caches.undo(run_id)
        else:
            count = rng.randint(2, len(live)) if len(live) > 1 else 1
            chosen = rng.sample(live, count)
            if rng.random() < 0.7 and count > 1:  # the common case: the same group again
                chosen = sorted(chosen)
            refs = [CacheRef(s, 0, fresh=False, rows=model.rows[s], positions=1) for s in chosen]
            if len(refs) < 2:
                continue
            run_id += 1
            value += 1
            caches.begin(run_id, refs)
            stacked = caches.fused(refs)
            outcome = rng.choice(("done", "done", "done", "failed", "aborted"))
            if outcome == "failed":  # after 0 or 1 of its layers
                _append(stacked.cache, value, layers=rng.randint(0, LAYERS - 1))
                caches.undo(run_id)
            else:
                _append(stacked.cache, value)
                caches.fused_done(refs, stacked)
                if outcome == "aborted":
                    caches.undo(run_id)
                else:
                    try:
                        caches.settle(chosen)
                    except ResourceExhaustedError:
                        caches.undo(run_id)
                    else:
                        for s in chosen:
                            model.values[s].append(value)
        model.bound(caches)
    model.check(caches)


@pytest.mark.parametrize("seed", range(6))
def test_long_random_sequences_keep_every_session_exact(seed: int) -> None:
    _sequence(seed, steps=400, budget=1 << 30)


@pytest.mark.parametrize("seed", range(4))
def test_long_random_sequences_near_the_budget_keep_every_session_exact(seed: int) -> None:
    """A budget that a few sessions of some dozen positions fill: runs fail over it, are
    undone, and stacks fall back to own caches."""
    _sequence(100 + seed, steps=400, budget=40 * BYTES_PER_POSITION_ROW * 2)
