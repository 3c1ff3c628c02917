"""A stage keeps a fused decode run's caches stacked for the next step of the same sessions
(see [Note: kept stack] in pipesvc.stage.compute.sessions)."""

from __future__ import annotations

import pytest
import torch

from pipesvc.core.microbatch import CacheRef
from pipesvc.errors import ResourceExhaustedError
from pipesvc.models.gpt import KVCache
from pipesvc.models.registry import CacheLayout
from pipesvc.stage.compute import fused_cache
from pipesvc.stage.compute.sessions import SessionCaches, held_bytes

LAYOUT = CacheLayout(tensors=KVCache.tensors, build=KVCache.from_tensors)
LENGTHS = {"a": 3, "b": 5, "c": 1}
ROWS = {"a": 1, "b": 2, "c": 1}


def _own(session: str, length: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Distinct keys and values for each session, layer and position."""
    base = float(ord(session)) * 1000
    k = base + torch.arange(length, dtype=torch.float32).view(1, 1, length, 1)
    k = k.expand(ROWS[session], 2, length, 4).clone()
    return {0: (k, k + 0.5), 1: (k + 100, k + 100.5)}


def _decode(session: str) -> CacheRef:
    return CacheRef(session, 0, fresh=False, rows=ROWS[session], positions=1)


def _caches(budget: int = 1 << 30) -> SessionCaches:
    caches = SessionCaches(KVCache, budget_bytes=budget, layout=LAYOUT, idle_s=60)
    for session, length in LENGTHS.items():
        ref = CacheRef(session, 0, fresh=True, rows=ROWS[session], positions=length)
        caches.begin(0, [ref])
        caches.put(ref, KVCache.from_tensors(_own(session, length)))
    return caches


def _forward(stacked: fused_cache.StackedCaches, value: float, layers: int = 2) -> None:
    """What a forward does to the cache it is given: each layer appends a position (a new
    tensor, as ``torch.cat`` makes), here ``value`` in every row."""
    store = stacked.cache._store
    for layer in range(layers):
        k, v = store[layer]
        column = torch.full((k.shape[0], k.shape[1], 1, k.shape[3]), value)
        store[layer] = (torch.cat([k, column], 2), torch.cat([v, column], 2))


def _run(caches: SessionCaches, run_id: int, refs: list[CacheRef], value: float) -> object:
    caches.begin(run_id, refs)
    stacked = caches.fused(refs)
    _forward(stacked, value)
    caches.fused_done(refs, stacked)
    caches.settle([r.session for r in refs])
    return stacked.cache


def _alone(caches: SessionCaches, session: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return LAYOUT.tensors(caches.get(_decode(session)))


def _expected(session: str, values: list[float]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    own = _own(session, LENGTHS[session])
    out = {}
    for layer, (k, v) in own.items():
        for value in values:
            column = torch.full((k.shape[0], k.shape[1], 1, k.shape[3]), value)
            k, v = torch.cat([k, column], 2), torch.cat([v, column], 2)
        out[layer] = (k, v)
    return out


def _assert_same(
    got: dict[int, tuple[torch.Tensor, torch.Tensor]],
    want: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    assert got.keys() == want.keys()
    for layer in want:
        torch.testing.assert_close(got[layer][0], want[layer][0], rtol=0, atol=0)
        torch.testing.assert_close(got[layer][1], want[layer][1], rtol=0, atol=0)


def test_the_same_parts_run_on_the_kept_stack_and_come_back_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caches = _caches()
    stacks = []
    stack = fused_cache.stack
    monkeypatch.setattr(fused_cache, "stack", lambda *a: stacks.append(1) or stack(*a))
    refs = [_decode(s) for s in LENGTHS]
    first = _run(caches, 1, refs, 7.0)
    assert _run(caches, 2, refs, 8.0) is first  # no new stack: the same cache ran on
    _run(caches, 3, refs, 9.0)
    assert len(stacks) == 1
    # Kept stacked, the bytes counted are the stack's: the rows padded to the longest.
    assert caches.total_bytes() == held_bytes([first]) == 2 * 2 * 4 * 4 * 2 * 4 * (5 + 3)
    for session in LENGTHS:  # alone, each part is its own cache, exactly
        _assert_same(_alone(caches, session), _expected(session, [7.0, 8.0, 9.0]))
    # Now the parts are on their own again, and a fused run stacks them anew.
    _run(caches, 4, refs, 10.0)
    assert len(stacks) == 2
    _assert_same(_alone(caches, "b"), _expected("b", [7.0, 8.0, 9.0, 10.0]))


def test_other_parts_in_a_run_cut_the_stack_back() -> None:
    caches = _caches()
    _run(caches, 1, [_decode("a"), _decode("b"), _decode("c")], 7.0)
    _run(caches, 2, [_decode("a"), _decode("c")], 8.0)  # b's reader fell behind
    _run(caches, 3, [_decode("a"), _decode("b"), _decode("c")], 9.0)
    _assert_same(_alone(caches, "a"), _expected("a", [7.0, 8.0, 9.0]))
    _assert_same(_alone(caches, "b"), _expected("b", [7.0, 9.0]))
    _assert_same(_alone(caches, "c"), _expected("c", [7.0, 8.0, 9.0]))


@pytest.mark.parametrize("layers_done", [0, 1, 2])
def test_undo_puts_the_stack_back_after_a_run_that_failed_or_was_aborted(
    layers_done: int,
) -> None:
    """A run that failed after ``layers_done`` of 2 layers appended (2: it finished here and
    the coordinator aborted it) leaves every part as it was."""
    caches = _caches()
    refs = [_decode(s) for s in LENGTHS]
    _run(caches, 1, refs, 7.0)
    caches.begin(2, refs)
    stacked = caches.fused(refs)
    _forward(stacked, 8.0, layers=layers_done)
    if layers_done == 2:
        caches.fused_done(refs, stacked)
    caches.undo(2)
    _run(caches, 3, refs, 9.0)  # on the stack as it was
    for session in LENGTHS:
        _assert_same(_alone(caches, session), _expected(session, [7.0, 9.0]))


def test_a_released_session_leaves_the_others_whole() -> None:
    caches = _caches()
    refs = [_decode(s) for s in LENGTHS]
    _run(caches, 1, refs, 7.0)
    assert caches.session_bytes("b") > 0
    assert caches.release("b") > 0
    assert caches.sessions() == ["a", "c"]
    assert caches.session_bytes("b") == 0
    # What is left is exactly the others' own caches (no padding to b's length).
    own = sum(t.numel() * 4 for s in ("a", "c") for kv in _expected(s, [7.0]).values() for t in kv)
    assert caches.total_bytes() == own
    _run(caches, 2, [_decode("a"), _decode("c")], 8.0)
    _assert_same(_alone(caches, "a"), _expected("a", [7.0, 8.0]))
    _assert_same(_alone(caches, "c"), _expected("c", [7.0, 8.0]))


def test_a_stack_over_the_budget_by_its_padding_goes_back_to_own_caches() -> None:
    own = sum(t.numel() * 4 for s in LENGTHS for kv in _expected(s, [7.0]).values() for t in kv)
    padded = 2 * 2 * 4 * 4 * 2 * 4 * (5 + 1)  # 4 rows of 6 positions
    assert own < padded
    caches = _caches(budget=own)
    refs = [_decode(s) for s in LENGTHS]
    _run(caches, 1, refs, 7.0)  # fits as each part's own cache
    assert caches.total_bytes() == own
    for session in LENGTHS:
        _assert_same(_alone(caches, session), _expected(session, [7.0]))
    with pytest.raises(ResourceExhaustedError, match="over its budget"):
        _run(caches, 2, refs, 8.0)  # one more position each does not fit at all


def test_a_stack_that_is_mostly_padding_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """One long session beside short ones: the stack would hold far more than the parts own
    (see ``KEEP_PADDING``), so each part keeps its own cache between steps."""
    caches = SessionCaches(KVCache, budget_bytes=1 << 30, layout=LAYOUT, idle_s=60)
    lengths = {"a": 40, "b": 2, "c": 3}
    for session, length in lengths.items():
        ref = CacheRef(session, 0, fresh=True, rows=ROWS[session], positions=length)
        caches.begin(0, [ref])
        caches.put(ref, KVCache.from_tensors(_own(session, length)))
    stacks = []
    stack = fused_cache.stack
    monkeypatch.setattr(fused_cache, "stack", lambda *a: stacks.append(1) or stack(*a))
    refs = [_decode(s) for s in lengths]
    for run_id in (1, 2, 3):
        _run(caches, run_id, refs, float(run_id))
    assert len(stacks) == 3
    own = sum(ROWS[s] * (n + 3) * 2 * 4 * 4 * 2 * 2 for s, n in lengths.items())
    assert caches.total_bytes() == own
