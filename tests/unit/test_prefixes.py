"""Prompt prefixes: the coordinator's index of what the stages keep (see [Note: prefix index])
and a stage's kept prefixes within its KV budget (see [Note: prefix reuse])."""

from __future__ import annotations

import pytest
import torch

from pipesvc.coordinator.prefixes import BLOCK, Prefix, PrefixIndex
from pipesvc.coordinator.session import ModelSupport, Session, plan_step
from pipesvc.core.microbatch import CacheRef
from pipesvc.core.sampling import Sampling
from pipesvc.errors import InvalidArgumentError, ResourceExhaustedError, SessionCacheLostError
from pipesvc.models.gpt import KVCache
from pipesvc.models.registry import CacheLayout
from pipesvc.stage.compute.sessions import SessionCaches
from pipesvc.stage.run_request import check_prefix_ref
from pipesvc.v1 import stage_pb2

LAYOUT = CacheLayout(tensors=KVCache.tensors, build=KVCache.from_tensors)


def tokens(common: int, *extras: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts that start with the same ``common`` tokens, then ``extras[i]`` of their own."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 100, (common,), generator=g)
    return [torch.cat([start, torch.randint(0, 100, (n,), generator=g)]) for n in extras]


def test_a_prompt_starts_from_the_longest_kept_boundary_it_shares() -> None:
    index = PrefixIndex()
    first, second = tokens(3 * BLOCK + 5, 10, 40)
    assert index.find(first, epoch=1) is None
    keep = index.to_keep(first, epoch=1)
    # The most whole blocks short of the prompt: its last token must still run.
    assert keep == Prefix(keep.name if keep else "", 3 * BLOCK)
    assert keep is not None and index.kept(first, keep, epoch=1) == []
    assert index.to_keep(first, epoch=1) is None  # kept already
    assert index.find(first, epoch=1) == keep
    # Sharing 3 blocks and 5 tokens: the first 3 blocks of the kept cache.
    assert index.find(second, epoch=1) == Prefix(keep.name, 3 * BLOCK)
    assert index.find(tokens(80, 0, seed=1)[0], epoch=1) is None
    # Never all of a prompt: one of exactly the kept blocks starts a block short.
    assert index.find(first[: 3 * BLOCK], epoch=1) == Prefix(keep.name, 2 * BLOCK)
    # Another plan epoch: the stages hold nothing of the old one.
    assert index.find(second, epoch=2) is None and len(index) == 0
    assert index.kept(first, Prefix("stale", BLOCK), epoch=1) == ["stale"]
    # Kept in an epoch newer than any the index saw (a session's run after a recovery):
    # indexed for that epoch.
    assert index.kept(first, keep, epoch=3) == []
    assert index.find(second, epoch=3) == Prefix(keep.name, 3 * BLOCK)


def test_the_least_recently_used_prefix_goes_and_its_boundaries_fall_back() -> None:
    index = PrefixIndex(capacity=2)
    a, longer = tokens(BLOCK, BLOCK + 1, 2 * BLOCK + 1)  # one block in common
    (b,) = tokens(2 * BLOCK + 1, 0, seed=2)
    kept = []
    for prompt in (a, longer, b):
        prefix = index.to_keep(prompt, epoch=0)
        assert prefix is not None
        kept.append(prefix)
        evicted = index.kept(prompt, prefix, epoch=0)
    assert evicted == [kept[0].name] and len(index) == 2  # ``a``'s went first
    # ``a``'s first block is also ``longer``'s: it still resolves, to ``longer``'s cache.
    assert index.find(a, epoch=0) == Prefix(kept[1].name, BLOCK)
    assert index.find(b, epoch=0) == Prefix(kept[2].name, 2 * BLOCK)
    index.forget(kept[1].name)  # a stage dropped it
    assert index.find(a, epoch=0) is None and len(index) == 1


def _cache(length: int, value: float = 1.0) -> KVCache:
    k = torch.full((1, 2, length, 4), value)
    return KVCache.from_tensors({0: (k, k + 1), 1: (k + 2, k + 3)})


def _ref(session: str, **kw: object) -> CacheRef:
    fields: dict[str, object] = {"fresh": True, "rows": 1, "positions": 3, **kw}
    return CacheRef(session, 0, **fields)  # type: ignore[arg-type]


def test_a_stage_keeps_a_prefix_and_starts_sessions_from_copies_of_it() -> None:
    caches = SessionCaches(KVCache, budget_bytes=1 << 20, layout=LAYOUT, idle_s=60.0)
    first = _ref("a", keep_as="p", keep_positions=5)
    caches.begin(1, [first])
    caches.put(first, _cache(7))
    caches.keep([first])
    assert caches.prefixes() == ["p"]
    caches.settle(["a"])
    assert caches.total_bytes() == (7 + 5) * 4 * 2 * 4 * 4  # 2 layers x (k, v), 4-byte floats
    second = _ref("b", source="p", source_positions=3)
    caches.begin(2, [second])
    started = caches.get(second)
    k, v = LAYOUT.tensors(started)[0]
    assert k.shape[2] == 3 and torch.equal(v, torch.full((1, 2, 3, 4), 2.0))
    k.add_(100)  # the session's copy: the kept prefix does not change with it
    again = _ref("b2", source="p", source_positions=5)
    caches.begin(3, [again])
    assert torch.equal(LAYOUT.tensors(caches.get(again))[0][0], torch.full((1, 2, 5, 4), 1.0))
    kept = caches.release("p")
    assert kept == 5 * 4 * 2 * 4 * 4 and caches.prefixes() == []
    # A source this stage does not keep: the run fails before anything changes, naming the
    # session, which the coordinator then replays from its first token.
    third = _ref("c", source="p", source_positions=3)
    with pytest.raises(SessionCacheLostError) as lost:
        caches.begin(3, [third])
    assert list(lost.value.sessions) == ["c"]
    short = _ref("e", keep_as="q", keep_positions=2)
    caches.begin(4, [short])
    caches.put(short, _cache(3))
    caches.keep([short])
    with pytest.raises(SessionCacheLostError):  # kept with 2 positions, asked for 3
        caches.begin(5, [_ref("f", source="q", source_positions=3)])


def test_a_stage_whose_layers_keep_no_cache_serves_its_prefixes_too() -> None:
    """A stage holding only the embedding or only the head (4 stages of an 8-block Llama)
    keeps its sessions' caches empty; a session starting from a prefix must not find that
    prefix short there, or every such session is replayed from its first token."""
    caches = SessionCaches(KVCache, budget_bytes=1 << 20, layout=LAYOUT, idle_s=60.0)
    first = _ref("a", keep_as="p", keep_positions=16)
    caches.begin(1, [first])
    caches.get(first)  # the run's cache, which no layer of this stage extends
    caches.keep([first])
    caches.settle(["a"])
    assert caches.prefixes() == ["p"]
    second = _ref("b", source="p", source_positions=16)
    caches.begin(2, [second])
    assert LAYOUT.tensors(caches.get(second)) == {}
    with pytest.raises(SessionCacheLostError):  # a prefix it never kept is still lost
        caches.begin(3, [_ref("c", source="q", source_positions=16)])


def test_a_full_budget_drops_the_least_recently_used_prefixes_before_failing() -> None:
    size = 4 * 2 * 4 * 4  # one position's bytes
    caches = SessionCaches(KVCache, budget_bytes=12 * size, layout=LAYOUT, idle_s=60.0)
    for name in ("p", "q"):
        ref = _ref(f"s-{name}", keep_as=name, keep_positions=3)
        caches.begin(1, [ref])
        caches.put(ref, _cache(3))
        caches.keep([ref])
        caches.release(f"s-{name}")
    caches.begin(2, [_ref("x", source="p", source_positions=3)])  # p is used: q is older now
    caches.get(_ref("x", source="p", source_positions=3))
    big = _ref("y")
    caches.begin(3, [big])
    caches.put(big, _cache(4))
    caches.settle(["x", "y"])  # 3 + 4 of sessions, 3 + 3 of prefixes: q goes
    assert caches.prefixes() == ["p"]
    huge = _ref("z")
    caches.begin(4, [huge])
    caches.put(huge, _cache(8))
    with pytest.raises(ResourceExhaustedError, match="over its budget"):
        caches.settle(["z"])
    assert caches.prefixes() == []  # every prefix went before the run failed


def test_a_session_starting_from_a_prefix_sends_only_the_rest_of_its_prompt() -> None:
    support = ModelSupport(kv_cache=True, side_inputs=("attention_mask",), fuses_caches=True)
    prompt = torch.arange(40)[None]
    s = Session(prompt, None, parts=1, sampling=Sampling(), support=support)
    assert s.one_row
    s.source, s.keep = Prefix("p", 32), Prefix("k", 32)
    other = Session(torch.arange(5)[None], None, parts=1, sampling=Sampling(), support=support)
    run = plan_step([s, other], epoch=1, fuse=True)
    ref = run.batch.caches[0][0]
    assert (ref.fresh, ref.source, ref.source_positions, ref.positions) == (True, "p", 32, 8)
    assert (ref.keep_as, ref.keep_positions) == ("k", 32)
    assert torch.equal(run.batch.inputs[0], prompt[:, 32:])  # alone: not fused with ``other``
    assert run.batch.side[0]["attention_mask"].shape == (1, 40)
    s.invalidate()  # lost: the replay starts from the first token, not from the prefix
    assert s.source is None and plan_step([s], epoch=1).batch.inputs[0].shape == (1, 40)


@pytest.mark.parametrize(
    ("fields", "fused", "match"),
    [
        ({"source": "p", "source_positions": 3, "rows": 2}, False, "one row"),
        ({"source": "p", "source_positions": 0}, False, "positions > 0"),
        ({"keep_as": "k" * 129, "keep_positions": 3}, False, "129 characters"),
        ({"keep_as": "k", "keep_positions": 3}, True, "fused"),
        ({"source": "p", "source_positions": 3, "fresh": False}, False, "not fresh"),
    ],
)
def test_a_stage_refuses_prefix_fields_that_do_not_fit(
    fields: dict[str, object], fused: bool, match: str
) -> None:
    ref = stage_pb2.CacheRef(session="s", part=0, **{"fresh": True, "rows": 1, **fields})
    with pytest.raises(InvalidArgumentError, match=match):
        check_prefix_ref(ref, fused=fused)
    check_prefix_ref(stage_pb2.CacheRef(session="s", fresh=True, rows=1), fused=fused)
