"""A generation session on the coordinator and the choice of tokens (pure: no stages)."""

from __future__ import annotations

import pytest
import torch

from pipesvc.coordinator.prefixes import Prefix
from pipesvc.coordinator.session import ModelSupport, Session, plan_step
from pipesvc.core.sampling import Sampling
from pipesvc.errors import InvalidArgumentError

CACHED = ModelSupport(kv_cache=True, side_inputs=("attention_mask", "position_ids"))


def session(support: ModelSupport = CACHED, eos: int | None = None) -> Session:
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13]])
    mask = (ids != 0).long()
    return Session(ids, mask, parts=2, sampling=Sampling(), support=support, eos_token_id=eos)


def logits_for(tokens: list[int], vocab: int = 20) -> list[torch.Tensor]:
    rows = torch.full((len(tokens), vocab), -1.0)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return [rows[:2], rows[2:]]  # the session's two parts: rows [0, 1] and [2]


def test_the_prompt_goes_whole_then_one_position_per_step() -> None:
    s = session()
    first = s.next_batch(epoch=1)
    assert [t.shape for t in first.inputs] == [(2, 4), (1, 4)]
    assert [c.fresh for (c,) in first.caches] == [True, True]
    # Positions count each row's real tokens from 0, as transformers' generate does.
    assert first.side[0]["position_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert torch.equal(s.advance(logits_for([3, 4, 5]), epoch=1), torch.tensor([3, 4, 5]))
    second = s.next_batch(epoch=1)
    assert [t.tolist() for t in second.inputs] == [[[3], [4]], [[5]]]
    assert [c.fresh for (c,) in second.caches] == [False, False]
    assert second.side[0]["position_ids"].tolist() == [[2], [4]]
    assert second.side[1]["attention_mask"].tolist() == [[0, 1, 1, 1, 1]]


def test_lost_caches_replay_every_token_so_far() -> None:
    s = session()
    s.next_batch(epoch=1)
    s.advance(logits_for([3, 4, 5]), epoch=1)
    after_recovery = s.next_batch(epoch=2)  # a new plan epoch: the stages have no caches
    assert [t.shape[1] for t in after_recovery.inputs] == [5, 5]
    assert all(c.fresh for (c,) in after_recovery.caches)
    s.invalidate()  # a stage dropped them (idle)
    assert all(c.fresh for (c,) in s.next_batch(epoch=1).caches)


def test_a_model_without_caches_gets_the_whole_sequence_each_step() -> None:
    s = session(ModelSupport(kv_cache=False, side_inputs=("attention_mask",)))
    s.advance(logits_for([3, 4, 5]), epoch=1)
    batch = s.next_batch(epoch=1)
    assert [t.shape[1] for t in batch.inputs] == [5, 5] and batch.caches == []
    with pytest.raises(InvalidArgumentError, match="reads no attention_mask"):
        session(ModelSupport(kv_cache=False, side_inputs=()))


def test_finished_rows_repeat_the_end_token_until_all_finish() -> None:
    s = session(eos=4)
    assert s.advance(logits_for([3, 4, 5]), epoch=1).tolist() == [3, 4, 5]
    assert s.advance(logits_for([4, 9, 9]), epoch=1).tolist() == [4, 4, 9]
    assert not s.done
    s.advance(logits_for([1, 1, 4]), epoch=1)
    assert s.done


def test_sampling_is_greedy_at_zero_and_repeats_with_a_seed() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(0))
    greedy = Sampling()
    assert torch.equal(greedy.choose(logits, greedy.generator()), logits.argmax(-1))
    top1 = Sampling(temperature=2.0, top_k=1, seed=3)
    assert torch.equal(top1.choose(logits, top1.generator()), logits.argmax(-1))
    nucleus = Sampling(temperature=1.0, top_p=1e-6, seed=3)  # only the most likely survives
    assert torch.equal(nucleus.choose(logits, nucleus.generator()), logits.argmax(-1))
    hot = Sampling(temperature=1.0, seed=9)
    draws = [hot.choose(logits, hot.generator()) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    with pytest.raises(InvalidArgumentError, match="top_k"):
        Sampling(top_k=0)


def test_decode_parts_of_several_sessions_fuse_and_their_logits_find_their_way_back() -> None:
    support = ModelSupport(
        kv_cache=True, side_inputs=("attention_mask", "position_ids"), fuses_caches=True
    )
    a, b, fresh = session(support), session(support), session(support)
    b.advance(logits_for([1, 2, 3]), epoch=1)  # b is one token longer than a
    for s in (a, b):
        s.advance(logits_for([3, 4, 5]), epoch=1)
    run = plan_step([a, b, fresh], epoch=1, fuse=True)
    batch = run.batch
    # fresh's two prompt parts share one micro-batch; the four decode parts share another.
    assert [t.shape for t in batch.inputs] == [(3, 4), (6, 1)]
    refs = [[(r.session, r.part, r.fresh, r.rows, r.positions) for r in c] for c in batch.caches]
    assert refs == [
        [(fresh.id, 0, True, 2, 4), (fresh.id, 1, True, 1, 4)],
        [(a.id, 0, False, 2, 1), (a.id, 1, False, 1, 1),
         (b.id, 0, False, 2, 1), (b.id, 1, False, 1, 1)],
    ]  # fmt: skip
    # The masks are left-padded to the longest (b's); each row keeps its own positions.
    assert batch.side[1]["attention_mask"].tolist() == [
        [0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1],
    ]  # fmt: skip
    assert batch.side[1]["position_ids"].tolist() == [[2], [4], [3], [3], [5], [4]]
    outputs = [torch.full((t.shape[0], 1), float(mb)) for mb, t in enumerate(batch.inputs)]
    outputs[1] = torch.arange(20.0, 26.0)[:, None]
    logits = run.logits(outputs)
    assert [[t.flatten().tolist() for t in parts] for parts in logits] == [
        [[20.0, 21.0], [22.0]], [[23.0, 24.0], [25.0]], [[0.0, 0.0], [0.0]]
    ]  # fmt: skip
    unfused = plan_step([a, b], epoch=1)  # without fusing, each part is its own micro-batch
    assert [len(refs) for refs in unfused.batch.caches] == [1, 1, 1, 1]


def test_prompts_of_different_lengths_fuse_left_padded() -> None:
    support = ModelSupport(
        kv_cache=True, side_inputs=("attention_mask", "position_ids"), fuses_caches=True
    )
    short = Session(torch.tensor([[7, 8]]), None, parts=1, sampling=Sampling(), support=support)
    batch = plan_step([session(support), short], epoch=1, fuse=True).batch
    assert len(batch.inputs) == 1
    assert batch.inputs[0].tolist() == [[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13], [0, 0, 7, 8]]
    assert batch.side[0]["attention_mask"][3].tolist() == [0, 0, 1, 1]
    assert batch.side[0]["position_ids"][3].tolist() == [0, 0, 0, 1]
    assert [(r.rows, r.positions) for r in batch.caches[0]] == [(2, 4), (1, 4), (1, 2)]


def test_a_run_of_greedy_sessions_asks_the_last_stage_for_tokens_only() -> None:
    greedy, hot = session(), session()
    hot.sampling = Sampling(temperature=1.0, seed=1)
    assert plan_step([greedy], epoch=1).batch.greedy
    assert not plan_step([greedy, hot], epoch=1).batch.greedy  # hot needs the logits
    # The last stage's tokens (one per row, per part) are the session's new tokens.
    assert greedy.advance([torch.tensor([3, 4]), torch.tensor([5])], epoch=1).tolist() == [3, 4, 5]
    assert greedy.tokens[:, -1].tolist() == [3, 4, 5]


FUSING = ModelSupport(
    kv_cache=True, side_inputs=("attention_mask", "position_ids"), fuses_caches=True
)


def test_a_long_prompt_runs_in_chunks_that_extend_one_cache_in_order() -> None:
    ids = torch.arange(1, 11).repeat(3, 1)  # 3 rows of 10 tokens
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    s = Session(ids, mask, parts=2, sampling=Sampling(), support=FUSING, prefill_chunk=4)
    other = Session(ids[:1, :3], None, parts=1, sampling=Sampling(), support=FUSING)
    run = plan_step([s, other], epoch=1, fuse=True)
    batch = run.batch
    # Each part's 10 tokens in chunks of 4, 4 and 2, in order, each chunk its own micro-batch.
    widths = [t.shape[1] for t in batch.inputs]
    assert widths == [4, 4, 2, 4, 4, 2, 3]
    refs = [refs[0] for refs in batch.caches]
    assert [(r.session, r.part, r.fresh, r.positions) for r in refs[:3]] == [
        (s.id, 0, True, 4), (s.id, 0, False, 4), (s.id, 0, False, 2)
    ]  # fmt: skip
    assert [r.part for r in refs[3:6]] == [1, 1, 1]
    # Each chunk's mask reaches its own end; its positions are its own.
    assert [m["attention_mask"].shape[1] for m in batch.side[:3]] == [4, 8, 10]
    assert batch.side[1]["position_ids"].tolist() == [[4, 5, 6, 7], [1, 2, 3, 4]]
    # The next token comes from each part's last chunk.
    outputs = [torch.full((t.shape[0],), float(mb)) for mb, t in enumerate(batch.inputs)]
    assert [p.tolist() for p in run.logits(outputs)[0]] == [[2.0, 2.0], [5.0]]
    s.advance([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], epoch=1)
    assert [t.shape for t in s.next_batch(epoch=1).inputs] == [(2, 1), (1, 1)]  # decode: whole


def test_chunks_only_where_the_stages_can_cut_caches_back_and_not_when_off() -> None:
    ids = torch.arange(1, 11)[None]
    for support, chunk in ((CACHED, 4), (FUSING, 0), (FUSING, 10)):
        s = Session(ids, None, parts=1, sampling=Sampling(), support=support, prefill_chunk=chunk)
        assert [t.shape[1] for t in s.next_batch(epoch=1).inputs] == [10]


def test_beside_a_decoding_session_a_long_prompt_sends_one_chunk_per_run() -> None:
    """See [Note: chunks between decode steps]: each run holds the decode step and one chunk
    of each part of the prompt, which makes no token until its last chunk ran; alone, the
    prompt's chunks all go in one run."""
    decoding = Session(
        torch.tensor([[3, 4, 5]]), None, parts=1, sampling=Sampling(), support=FUSING
    )
    plan_step([decoding], epoch=1, fuse=True)
    decoding.advance([torch.tensor([7])], epoch=1)
    assert decoding.decodes(1) and not decoding.decodes(2)  # another epoch: a replay
    ids = torch.arange(1, 11).repeat(2, 1)
    prompt = Session(ids, None, parts=2, sampling=Sampling(), support=FUSING, prefill_chunk=4)
    prompt.keep = Prefix("p", 8)  # what the coordinator would keep of it
    made = []
    for reach in (4, 8, 10):
        run = plan_step([decoding, prompt], epoch=1, fuse=True)
        chunk = [r for refs in run.batch.caches for r in refs if r.session == prompt.id]
        # One chunk per part, fresh only in the first run, never keeping a prefix.
        start = (reach - 1) // 4 * 4
        assert [(r.part, r.positions, r.fresh, r.keep_as) for r in chunk] == [
            (0, reach - start, reach == 4, ""), (1, reach - start, reach == 4, "")
        ]  # fmt: skip
        decoding.advance([torch.tensor([7])], epoch=1)
        made.append(prompt.advance([torch.tensor([1]), torch.tensor([2])], epoch=1))
        assert prompt.cached == (reach if reach < 10 else 10)
    assert made[:2] == [None, None] and made[2] is not None and made[2].tolist() == [1, 2]
    assert prompt.keep is None
    # With no session decoding, a prompt's chunks all go in one run.
    alone = Session(ids, None, parts=1, sampling=Sampling(), support=FUSING, prefill_chunk=4)
    run = plan_step([alone], epoch=1, fuse=True)
    assert [t.shape[1] for t in run.batch.inputs] == [4, 4, 2]
    assert alone.advance([torch.tensor([1, 2])], epoch=1) is not None


def test_log_probabilities_are_the_models_own_and_make_the_last_stage_send_logits() -> None:
    ids = torch.tensor([[1, 2, 3]])
    sampled = Sampling(temperature=0.7, top_k=2, seed=3)
    asking = Session(ids, None, parts=1, sampling=Sampling(), support=CACHED, logprobs=3)
    plain = Session(ids, None, parts=1, sampling=Sampling(), support=CACHED)
    drawn = Session(ids, None, parts=1, sampling=sampled, support=CACHED, logprobs=0)
    # A greedy run gets only the last stage's arg-max, unless a session asks for figures.
    assert plan_step([plain], epoch=1).batch.greedy
    assert not plan_step([plain, asking], epoch=1).batch.greedy
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.5, 0.0, 1.0]])
    expected = torch.log_softmax(logits, dim=-1)[0]
    token = asking.advance([logits], epoch=1)
    assert token is not None and token.tolist() == [1]
    scored = asking.last_logprobs
    assert scored is not None
    assert torch.allclose(scored.chosen, expected[1:2])
    assert scored.top_ids.tolist() == [[1, 3, 5]]
    assert torch.allclose(scored.top, expected[[1, 3, 5]][None])
    assert plain.advance([logits], epoch=1) is not None and plain.last_logprobs is None
    # Sampled with temperature and top-k: still the model's own distribution, before them.
    token = drawn.advance([logits], epoch=1)
    assert token is not None and drawn.last_logprobs is not None
    assert torch.allclose(drawn.last_logprobs.chosen, expected[token])
    assert drawn.last_logprobs.top.shape == (1, 0)
    for bad in (-1, 21, True):
        with pytest.raises(InvalidArgumentError, match=r"must be an integer in \[0, 20\]"):
            Session(ids, None, parts=1, sampling=Sampling(), support=CACHED, logprobs=bad)
