"""The step engine in one process: P engines wired by in-process sends train exactly like the
whole model in one process, for every schedule; an abort commits nothing; runs are ordered.
The engines are wired as ``tests.support.pipeline.Pipeline`` describes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import torch

from pipesvc import models
from pipesvc.coordinator.session import ModelSupport, Session, plan_step
from pipesvc.core import microbatch, schedule
from pipesvc.core.clipping import clip_scale, total_norm_sq
from pipesvc.core.microbatch import CacheRef
from pipesvc.core.sampling import Sampling
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionCacheLostError,
    StageUnavailableError,
    StepAbortedError,
)
from pipesvc.stage.compute import fused_cache
from pipesvc.stage.compute.engine import Carried, RunInputs, RunResult, StepEngine
from pipesvc.stage.compute.faults import FaultKill
from pipesvc.stage.dataplane.mailbox import ACTIVATION, NORM_PART, MailKey
from tests.support.pipeline import NUM_MICROBATCHES, Pipeline
from tests.support.reference import DROPOUT_GPT, PROBLEMS, Problem, Reference

GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6
WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 1e-5
OPTIMIZER_CYCLE = [
    {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
    {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    {"name": "adam", "lr": 1e-2, "betas": [0.8, 0.95]},
]
# Even, uneven (7 = 2+2+2+1) and uneven-the-other-way (9) batches over 4 micro-batches.
BATCH_SIZES = (8, 7, 9)


@pytest.fixture(autouse=True)
def _one_thread_per_engine() -> Iterator[None]:
    """Each engine computes on one thread, as a stage of a one-thread-per-stage cluster does:
    P engines each starting torch's intra-op pool oversubscribe the cores many times over,
    and a test then takes seconds instead of milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CASES = [
    (model, name, num_stages)
    for model in sorted(PROBLEMS)
    for name in schedule.schedule_names()
    for num_stages in (2, 3, 4)
]


def _assert_tensors(
    actual: dict[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    rtol: float = WEIGHT_RTOL,
    atol: float = WEIGHT_ATOL,
) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(
            actual[key], value, rtol=rtol, atol=atol, msg=_prefixed(f"{key}: ")
        )


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda message: prefix + message


@pytest.mark.parametrize(("model", "schedule_name", "num_stages"), CASES)
def test_engines_train_like_one_process(model: str, schedule_name: str, num_stages: int) -> None:
    """Losses, gradients and weights after each commit equal the one-process reference's, on
    even and uneven micro-batches (cnn at 4 stages puts its parameter-free Flatten alone)."""
    index = CASES.index((model, schedule_name, num_stages))
    problem = PROBLEMS[model]
    optimizer = OPTIMIZER_CYCLE[index % len(OPTIMIZER_CYCLE)]
    clip = 0.5 if index % 2 else None
    seed = 100 + index
    reference = Reference(problem, seed=seed, optimizer=optimizer, clip_grad_norm=clip)
    pipeline = Pipeline(
        problem,
        schedule_name=schedule_name,
        num_stages=num_stages,
        seed=seed,
        optimizer=optimizer,
        clip_grad_norm=clip,
    )
    if model == "cnn" and num_stages == 4:  # the Flatten alone: a stage with no parameters
        assert [e.runtime.num_parameters == 0 for e in pipeline.engines].count(True) == 1
    _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())
    for step, batch_size in enumerate(BATCH_SIZES):
        x, y = problem.batch(batch_size, seed=step)
        expected_grads = reference.accumulated_gradients(x, y, NUM_MICROBATCHES)
        loss = pipeline.train_step(x, y)
        assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
        _assert_tensors(pipeline.tensors("gradients"), expected_grads, GRAD_RTOL, GRAD_ATOL)
        _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())
    assert [e.runtime.step for e in pipeline.engines] == [len(BATCH_SIZES)] * num_stages
    x, _ = problem.batch(5, seed=99)
    with torch.no_grad():
        expected_out = reference.model(x)
    torch.testing.assert_close(
        pipeline.forward(x), expected_out, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL
    )


@pytest.mark.parametrize("schedule_name", schedule.schedule_names())
@pytest.mark.parametrize("num_stages", [2, 4])
def test_engines_with_dropout_draw_the_reference_masks(schedule_name: str, num_stages: int) -> None:
    """A gpt with dropout: each step equals the reference's micro-batch accumulation."""
    optimizer = {"name": "adamw", "lr": 1e-3}
    reference = Reference(DROPOUT_GPT, seed=5, optimizer=optimizer, clip_grad_norm=1.0)
    pipeline = Pipeline(
        DROPOUT_GPT,
        schedule_name=schedule_name,
        num_stages=num_stages,
        seed=5,
        optimizer=optimizer,
        clip_grad_norm=1.0,
        num_microbatches=3,
    )
    for step in range(2):
        x, y = DROPOUT_GPT.batch(7, seed=step)
        loss = pipeline.train_step(x, y)
        assert loss == pytest.approx(reference.step(x, y, 3), rel=1e-5, abs=1e-6)
        _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())


@pytest.mark.parametrize("schedule_name", ["1f1b", "zb-h1"])
def test_runs_of_every_kind_on_one_engine_follow_the_reference(schedule_name: str) -> None:
    """An engine works a kind of run's actions out once (training or not, its micro-batch
    count) and reuses them: training runs of 3, 2 and again 3 micro-batches, with an inference
    run between them, each still equals the reference, dropout masks included."""
    optimizer = {"name": "sgd", "lr": 0.05}
    reference = Reference(DROPOUT_GPT, seed=7, optimizer=optimizer, clip_grad_norm=None)
    pipeline = Pipeline(
        DROPOUT_GPT,
        schedule_name=schedule_name,
        num_stages=2,
        seed=7,
        optimizer=optimizer,
        clip_grad_norm=None,
        num_microbatches=3,
    )
    for step, batch_size in enumerate((7, 2, 7, 2)):
        x, y = DROPOUT_GPT.batch(batch_size, seed=step)
        count = min(3, batch_size)
        loss = pipeline.train_step(x, y)
        assert loss == pytest.approx(reference.step(x, y, count), rel=1e-5, abs=1e-6)
        _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())
        x, _ = DROPOUT_GPT.batch(3, seed=50 + step)
        reference.model.eval()
        with torch.no_grad():
            expected = reference.model(x)
        reference.model.train()
        torch.testing.assert_close(pipeline.forward(x), expected, rtol=1e-5, atol=1e-6)
    plans = pipeline.engines[0]._plans
    assert sorted(plans) == [(False, 3), (True, 2), (True, 3)]


def _pipeline(
    problem: Problem,
    num_stages: int = 3,
    fault_kill: FaultKill | None = None,
    kv_budget: int = 2**30,
    clip_grad_norm: float | None = None,
) -> Pipeline:
    return Pipeline(
        problem,
        schedule_name="1f1b",
        num_stages=num_stages,
        seed=3,
        optimizer={"name": "sgd", "lr": 0.1},
        clip_grad_norm=clip_grad_norm,
        fault_kill=fault_kill,
        kv_budget=kv_budget,
    )


@pytest.mark.parametrize("schedule_name", schedule.schedule_names())
def test_abort_mid_run_commits_nothing(schedule_name: str) -> None:
    """A send fails in the middle of a run: that stage's run fails, the abort wakes the others,
    nothing is committed or left pending, and the next run trains like the reference."""
    problem = PROBLEMS["mlp"]
    reference = Reference(
        problem, seed=3, optimizer={"name": "sgd", "lr": 0.1}, clip_grad_norm=None
    )
    pipeline = _pipeline(problem)
    pipeline.fail_send = (1, 1)
    before = {k: v.clone() for k, v in pipeline.tensors("parameters").items()}
    x, y = problem.batch(8, seed=0)
    results = pipeline.run(x, y, run_id=1)
    assert isinstance(results[1], StageUnavailableError), results
    # The others' runs were woken by the abort (or, a thread started late, refused after it).
    others = (StepAbortedError, FailedPreconditionError)
    assert all(isinstance(r, others) for r in results[:1] + results[2:]), results
    for engine in pipeline.engines:
        assert engine.pending_commit is None
        assert engine.runtime.step == 0
        assert engine.runtime.live == 0
        with pytest.raises(FailedPreconditionError, match="run 1 has nothing to commit"):
            engine.commit(1, None)
    _assert_tensors(pipeline.tensors("parameters"), before)
    assert pipeline.tensors("gradients") == {}

    pipeline.fail_send = None
    pipeline.run_id = 1
    loss = pipeline.train_step(x, y)
    assert loss == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
    _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())


def test_a_run_waits_for_the_pending_commit_and_runs_are_ordered() -> None:
    problem = PROBLEMS["mlp"]
    pipeline = _pipeline(problem, num_stages=2)
    x, y = problem.batch(8, seed=0)
    assert all(isinstance(r, RunResult) for r in pipeline.run(x, y, run_id=1))
    data = RunInputs(inputs=microbatch.split(x, 4), targets=[], loss_weights=[])
    first = pipeline.engines[0]
    with pytest.raises(FailedPreconditionError, match="run 1 awaits commit or abort; run 2 waits"):
        first.run_step(2, training=True, num_microbatches=4, data=data)
    assert (first.pending_commit, first.last_run_id) == (1, 1)
    with pytest.raises(FailedPreconditionError, match="run 2 has nothing to commit"):
        first.commit(2, None)
    for engine in pipeline.engines:
        assert engine.commit(1, None) == 1
    with pytest.raises(FailedPreconditionError, match="run 1 is not after the last run 1"):
        first.run_step(1, training=True, num_microbatches=4, data=data)
    pipeline.abort(5)
    with pytest.raises(FailedPreconditionError, match="run 3 is not after the last run 5"):
        first.run_step(3, training=True, num_microbatches=4, data=data)


@pytest.mark.parametrize("when", ["forward", "backward", "commit"])
def test_injected_fault_fails_its_point_once(when: str, tmp_path: Path) -> None:
    """A ``fail`` fault at rank 1's forward or backward of step 1 fails that run there (the
    others are aborted, nothing is committed); at its commit, the commit fails and the run
    stays pending. The fault fires once: the retry trains like the reference."""
    problem = PROBLEMS["mlp"]
    reference = Reference(
        problem, seed=3, optimizer={"name": "sgd", "lr": 0.1}, clip_grad_norm=None
    )
    fault = FaultKill(when=when, step=1, rank=1, marker=str(tmp_path / "fired"), action="fail")
    pipeline = _pipeline(problem, fault_kill=fault)
    x, y = problem.batch(8, seed=0)
    results = pipeline.run(x, y, run_id=1)
    if when == "commit":
        assert all(isinstance(r, RunResult) for r in results), results
        with pytest.raises(ResourceExhaustedError, match="fault injection: commit of step 1"):
            pipeline.engines[1].commit(1, None)
        assert pipeline.engines[1].pending_commit == 1
        for engine in pipeline.engines:
            assert engine.commit(1, None) == 1
    else:
        assert isinstance(results[1], ResourceExhaustedError), results
        assert [e.runtime.step for e in pipeline.engines] == [0, 0, 0]
        pipeline.run_id = 1
        pipeline.train_step(x, y)
    assert (tmp_path / "fired").exists()
    reference.step(x, y)
    _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())


def test_a_carried_commit_is_checked_applied_first_and_kept_by_a_later_abort() -> None:
    """The next run carries the pending run's commit (see [Note: deferred commit]): a carried
    commit of a run not pending here fails before anything changes; the abort of a run that
    never began keeps the pending gradients; a carried commit then trains like commit-then-run."""
    problem = PROBLEMS["mlp"]
    reference = Reference(
        problem, seed=3, optimizer={"name": "sgd", "lr": 0.1}, clip_grad_norm=None
    )
    pipeline = _pipeline(problem, num_stages=2)
    x, y = problem.batch(8, seed=0)
    assert all(isinstance(r, RunResult) for r in pipeline.run(x, y, run_id=1))
    reference.step(x, y)
    first = pipeline.engines[0]
    data = RunInputs(inputs=microbatch.split(x, 4), targets=[], loss_weights=[])
    with pytest.raises(FailedPreconditionError, match="run 7 has nothing to commit"):
        first.run_step(
            2,
            training=False,
            num_microbatches=4,
            data=data,
            commit=Carried(run_id=7, grad_scale=None),
        )
    assert (first.pending_commit, first.last_run_id, first.runtime.step) == (1, 1, 0)

    pipeline.abort(2)  # run 2 began nowhere: run 1 stays pending everywhere
    assert [(e.pending_commit, e.last_run_id) for e in pipeline.engines] == [(1, 2)] * 2

    x2, y2 = problem.batch(7, seed=1)
    results = pipeline.run(x2, y2, run_id=3, commit=Carried(run_id=1, grad_scale=None))
    assert all(isinstance(r, RunResult) for r in results), results
    assert [(e.pending_commit, e.runtime.step) for e in pipeline.engines] == [(3, 1)] * 2
    _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())
    for engine in pipeline.engines:
        engine.commit(3, None)
    reference.step(x2, y2)
    _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())


def _generate(
    pipeline: Pipeline,
    prompts: list[torch.Tensor],
    steps: int,
    *,
    fuse: bool,
    decode_steps: int = 1,
    eos: int | None = None,
    sampling: Callable[[int], Sampling] = lambda i: Sampling(),
) -> list[torch.Tensor]:
    """Greedy generation of every prompt as one session each, all sessions' steps in one run
    per step, as the coordinator's batcher runs them (decode parts fused, or each alone; up to
    ``decode_steps`` steps a run, none past the token limit, a finished session's dropped)."""
    features = pipeline.engines[0].runtime.features
    support = ModelSupport(
        kv_cache=True, side_inputs=features.side_inputs, fuses_caches=features.fuses_caches
    )
    sessions = [
        Session(
            p,
            None,
            parts=min(2, p.shape[0]),
            sampling=sampling(i),
            support=support,
            eos_token_id=eos,
        )
        for i, p in enumerate(prompts)
    ]
    made = 0
    while made < steps and not all(s.done for s in sessions):
        live = [s for s in sessions if not s.done]
        run = plan_step(live, 1, fuse=fuse, steps=min(decode_steps, steps - made))
        pipeline.run_id += 1
        results = pipeline.run_batch(run.batch, pipeline.run_id, generating=True)
        last = results[-1]
        assert isinstance(last, RunResult), results
        if run.batch.sampling:  # as the coordinator takes them
            for session, state in zip(live, last.generator_states, strict=True):
                if not session.sampling.greedy:
                    session.advance_generator(state)
        for session, taken in zip(live, run.steps(last.outputs), strict=True):
            for logits in taken:
                if not session.done:
                    session.advance(logits, 1)
        made += len(run.steps(last.outputs)[0])
    return [s.tokens for s in sessions]


@pytest.mark.parametrize("num_stages", [2, 3])
def test_sessions_fused_into_shared_micro_batches_generate_their_own_tokens(
    num_stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of sessions with different lengths and row counts, fused into shared
    micro-batches on every stage, give each session the tokens it gets alone, and the one
    process model's greedy tokens."""
    args = {**PROBLEMS["gpt"].model_args, "block_size": 32}
    problem = Problem("gpt", args, "cross_entropy", (8,))
    pipeline = _pipeline(problem, num_stages=num_stages)
    g = torch.Generator().manual_seed(8)
    vocab = 17
    prompts = [torch.randint(0, vocab, (1 + i % 3, 2 + 2 * i), generator=g) for i in range(5)]
    stacks: list[int] = []
    stack = fused_cache.stack

    def counted(*args: Any) -> fused_cache.StackedCaches:
        stacks.append(len(args[1]))
        return stack(*args)

    monkeypatch.setattr(fused_cache, "stack", counted)
    fused = _generate(pipeline, prompts, 6, fuse=True)
    # Each stage stacks the prompts' 8 parts, then the same 8 parts for the first decode step;
    # the later decode steps of the same parts run on that stack, kept (see [Note: kept
    # stack]).
    assert stacks == [8] * (2 * num_stages)
    alone = [_generate(pipeline, [p], 6, fuse=False)[0] for p in prompts]
    net = models.build(problem.model, seed=3, **problem.model_args).eval()
    for i, prompt in enumerate(prompts):
        tokens = prompt
        with torch.no_grad():
            for _ in range(6):  # the whole sequence each step, no caches
                tokens = torch.cat([tokens, net(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(alone[i], tokens), i
        assert torch.equal(fused[i], tokens), i
    for engine in pipeline.engines:  # the fused and the lone sessions all kept their caches
        assert engine.sessions is not None and len(engine.sessions.sessions()) == 5 + 5


def test_generation_runs_the_head_on_each_rows_last_position_only() -> None:
    """See [Note: last position only] in pipesvc.stage.compute.layer_calls: the prompt's run
    and every decode step call the last stage's head on one position a row; a forward that
    returns every position calls it on all of them."""
    args = {**PROBLEMS["gpt"].model_args, "block_size": 32}
    pipeline = _pipeline(Problem("gpt", args, "cross_entropy", (8,)), num_stages=2)
    head = pipeline.engines[-1].runtime._calls.chunks[0][-1][1]
    seen: list[list[int]] = []
    head.register_forward_hook(lambda module, given, out: seen.append(list(given[0].shape)))
    prompts = [torch.randint(0, 17, (2, 9), generator=torch.Generator().manual_seed(4))]
    tokens = _generate(pipeline, prompts, 3, fuse=True)
    assert tokens[0].shape == (2, 12)
    assert [shape[:2] for shape in seen] == [[2, 1]] * 3  # the prompt, then 2 decode steps
    pipeline.forward(prompts[0])  # a micro-batch a row
    assert [shape[1] for shape in seen[3:]] == [9, 9]


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("fuse", [True, False])
def test_decode_steps_on_the_stages_give_the_tokens_of_one_step_runs(
    num_stages: int, fuse: bool
) -> None:
    """Runs of up to 4 decode steps, the tokens handed from the last stage to the first (see
    [Note: decode steps on the stages]), give every session the tokens of one step a run and
    of the model in one process; an end-of-sequence token ends a session inside a run."""
    args = {**PROBLEMS["gpt"].model_args, "block_size": 32}
    problem = Problem("gpt", args, "cross_entropy", (8,))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 17, (1 + i % 3, 2 + 2 * i), generator=g) for i in range(4)]
    # Alone (without fusing) each run holds one session, as the batcher runs a single one.
    groups = [prompts] if fuse else [[p] for p in prompts]
    net = models.build(problem.model, seed=3, **problem.model_args).eval()
    for eos in (None, 5):
        one = [
            t
            for group in groups
            for t in _generate(_pipeline(problem, num_stages), group, 9, fuse=fuse, eos=eos)
        ]
        pipeline = _pipeline(problem, num_stages)
        many = [
            t
            for group in groups
            for t in _generate(pipeline, group, 9, fuse=fuse, decode_steps=4, eos=eos)
        ]
        for i, prompt in enumerate(prompts):
            assert torch.equal(many[i], one[i]), (i, eos)
            if eos is None:
                tokens = prompt
                with torch.no_grad():
                    for _ in range(9):
                        nxt = net(tokens)[:, -1].argmax(-1, keepdim=True)
                        tokens = torch.cat([tokens, nxt], dim=1)
                assert torch.equal(many[i], tokens), i
        # 9 tokens are the prompt's run and runs of at most 4 steps: 3 runs a group, when no
        # session ends early. Unfused, a session of two parts (two micro-batches) takes one
        # step a run: 9 runs.
        if eos is None:
            runs = [3 if fuse or group[0].shape[0] == 1 else 9 for group in groups]
            assert pipeline.run_id == sum(runs)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_sampled_sessions_draw_on_the_last_stage_what_the_coordinator_would_draw(
    num_stages: int,
) -> None:
    """Sessions that sample (temperature, top-k, top-p, each its own seed) beside a greedy one:
    runs of up to 4 decode steps, the last stage drawing their tokens from their generators
    (see [Note: sampling on the last stage]), give each the tokens of runs of one step, where
    the coordinator draws them, with an end-of-sequence token ending sessions inside runs."""
    args = {**PROBLEMS["gpt"].model_args, "block_size": 32}
    problem = Problem("gpt", args, "cross_entropy", (8,))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 17, (1 + i % 3, 2 + 2 * i), generator=g) for i in range(4)]
    settings = [
        Sampling(temperature=0.9, seed=1),
        Sampling(temperature=1.3, top_k=5, seed=2),
        Sampling(),  # greedy, in the same run
        Sampling(temperature=0.7, top_p=0.8, seed=3),
    ]
    for eos in (None, 3):
        one = _generate(
            _pipeline(problem, num_stages), prompts, 9, fuse=True, eos=eos,
            sampling=settings.__getitem__,
        )  # fmt: skip
        pipeline = _pipeline(problem, num_stages)
        many = _generate(
            pipeline, prompts, 9, fuse=True, decode_steps=4, eos=eos,
            sampling=settings.__getitem__,
        )  # fmt: skip
        for i in range(len(prompts)):
            assert torch.equal(many[i], one[i]), (i, eos)
        if eos is None:
            assert pipeline.run_id == 3  # the prompts', then runs of 4 and 4 steps
    # The draws are not all the greedy tokens (the sampling did something).
    greedy = _generate(_pipeline(problem, num_stages), prompts, 9, fuse=True)
    assert not all(torch.equal(a, b) for a, b in zip(many, greedy, strict=True))


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("failing_step", [0, 2])
def test_a_decode_run_that_fails_between_its_steps_leaves_every_session_as_it_was(
    num_stages: int, failing_step: int
) -> None:
    """A run of 4 decode steps on the kept stack of the run before fails at a step's send (the
    first, or the third after two steps extended every cache): every stage puts every session
    back as before the run, and the sessions go on to the tokens of a run without the fault."""
    args = {**PROBLEMS["gpt"].model_args, "block_size": 32}
    problem = Problem("gpt", args, "cross_entropy", (8,))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 17, (1 + i % 2, 3 + i), generator=g) for i in range(3)]
    expected = _generate(_pipeline(problem, num_stages), prompts, 9, fuse=True, decode_steps=4)
    pipeline = _pipeline(problem, num_stages)
    features = pipeline.engines[0].runtime.features
    support = ModelSupport(
        kv_cache=True, side_inputs=features.side_inputs, fuses_caches=features.fuses_caches
    )
    sessions = [
        Session(p, None, parts=min(2, p.shape[0]), sampling=Sampling(), support=support)
        for p in prompts
    ]

    def run(steps: int) -> list[RunResult | BaseException]:
        batch = plan_step(sessions, 1, fuse=True, steps=steps)
        pipeline.run_id += 1
        results = pipeline.run_batch(batch.batch, pipeline.run_id, generating=True)
        if isinstance(results[-1], RunResult):
            for session, taken in zip(sessions, batch.steps(results[-1].outputs), strict=True):
                for logits in taken:
                    session.advance(logits, 1)
        return results

    run(1)  # the prompts
    run(4)  # the stages keep the decode run's stack (see [Note: kept stack])
    before = [s.tokens.clone() for s in sessions]
    pipeline.fail_send = (num_stages - 2, failing_step)  # a step's activation is not sent
    failed = run(4)
    assert any(isinstance(r, StageUnavailableError) for r in failed), failed
    assert all(torch.equal(s.tokens, b) for s, b in zip(sessions, before, strict=True))
    pipeline.fail_send = None
    while sessions[0].tokens.shape[1] < prompts[0].shape[1] + 9:
        assert all(isinstance(r, RunResult) for r in run(4))
    for session, want in zip(sessions, expected, strict=True):
        assert torch.equal(session.tokens, want)


def _held(engine: StepEngine, refs: list[CacheRef]) -> tuple[int, int]:
    """What ``engine`` counts against its KV budget, and what the tensors of the caches of
    ``refs`` really keep alive: their untyped storages, each once (by data pointer) and whole."""
    assert engine.sessions is not None
    storages: dict[int, int] = {}
    for ref in refs:
        cache = engine.sessions.get(ref)
        for keys, values in cache.tensors().values():
            for t in (keys, values):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return engine.sessions.total_bytes(), sum(storages.values())


def _mixed_sessions(pipeline: Pipeline) -> tuple[list[Session], list[CacheRef]]:
    features = pipeline.engines[0].runtime.features
    support = ModelSupport(
        kv_cache=True, side_inputs=features.side_inputs, fuses_caches=features.fuses_caches
    )
    g = torch.Generator().manual_seed(3)
    lengths = [40, 2, 3, 2, 5, 2]  # one long prompt fused with short ones
    sessions = [
        Session(
            torch.randint(0, 17, (1 + i % 2, n), generator=g),
            None,
            parts=1 + i % 2,
            sampling=Sampling(),
            support=support,
        )
        for i, n in enumerate(lengths)
    ]
    refs = [
        CacheRef(s.id, part, fresh=False, rows=0, positions=0)
        for s in sessions
        for part in range(len(s.rows))
    ]
    return sessions, refs


def _step(pipeline: Pipeline, sessions: list[Session]) -> list[RunResult | BaseException]:
    run = plan_step(sessions, 1, fuse=True)
    pipeline.run_id += 1
    results = pipeline.run_batch(run.batch, pipeline.run_id, generating=True)
    last = results[-1]
    if isinstance(last, RunResult) and all(isinstance(r, RunResult) for r in results):
        for session, logits in zip(sessions, run.logits(last.outputs), strict=True):
            session.advance(logits, 1)
    return results


def test_the_kv_budget_counts_what_fused_caches_really_hold() -> None:
    """Sessions of mixed lengths (one long prompt, short ones) take fused decode steps, then
    the long one pauses while the others go on: after every run each stage counts exactly the
    bytes its caches' storages hold (a part cut from a stacked, left-padded cache must not keep
    the whole of it alive uncounted), and a budget one byte short of that refuses the run."""
    args = {**PROBLEMS["gpt"].model_args, "block_size": 64}
    problem = Problem("gpt", args, "cross_entropy", (8,))
    pipeline = _pipeline(problem, num_stages=2)
    sessions, refs = _mixed_sessions(pipeline)
    held_after: list[list[int]] = []
    for group in [sessions, sessions, sessions, sessions[1:], sessions[1:]]:
        assert all(isinstance(r, RunResult) for r in _step(pipeline, group))
        measured = [_held(engine, refs) for engine in pipeline.engines]
        for counted, held in measured:
            assert counted == held
        held_after.append([held for _, held in measured])
    # The same runs under a budget one byte short of what the third run leaves held: refused.
    budget = min(held_after[2]) - 1
    tight = _pipeline(problem, num_stages=2, kv_budget=budget)
    sessions, refs = _mixed_sessions(tight)
    _step(tight, sessions)
    _step(tight, sessions)
    failed = [r for r in _step(tight, sessions) if isinstance(r, ResourceExhaustedError)]
    assert failed and "over its budget" in str(failed[0])


def _lengths(engine: StepEngine, session: Session) -> list[int]:
    """The positions each part of ``session`` holds on ``engine``."""
    assert engine.sessions is not None
    lengths = []
    for part in range(len(session.rows)):
        ref = CacheRef(session.id, part, fresh=False, rows=0, positions=0)
        tensors = engine.sessions.get(ref).tensors()
        lengths.append(max(k.shape[2] for k, _ in tensors.values()))
    return lengths


def test_a_session_lost_on_one_stage_costs_the_others_nothing() -> None:
    """Sessions fused into one run; the last stage lost one of them (expired there): the run
    fails with a typed error naming just that session, every stage holds the others as before
    the run (the first stage ran its part before the abort), and that session alone replays;
    every session's tokens are the ones it gets alone."""
    args = {**PROBLEMS["gpt"].model_args, "block_size": 64}
    problem = Problem("gpt", args, "cross_entropy", (8,))
    pipeline = _pipeline(problem, num_stages=2)
    sessions, _ = _mixed_sessions(pipeline)
    for _ in range(3):
        assert all(isinstance(r, RunResult) for r in _step(pipeline, sessions))
    before = [[_lengths(e, s) for s in sessions[1:]] for e in pipeline.engines]
    last = pipeline.engines[-1]
    assert last.sessions is not None
    last.sessions.release(sessions[0].id)
    results = _step(pipeline, sessions)
    assert isinstance(results[-1], SessionCacheLostError), results
    assert results[-1].sessions == (sessions[0].id,)
    assert [[_lengths(e, s) for s in sessions[1:]] for e in pipeline.engines] == before
    sessions[0].invalidate()  # as the coordinator does with the sessions the error names
    for _ in range(3):
        assert all(isinstance(r, RunResult) for r in _step(pipeline, sessions))
    alone = _pipeline(problem, num_stages=2)
    for session in sessions:
        prompt = session.tokens[:, : session.prompt_length]
        (tokens,) = _generate(alone, [prompt], 6, fuse=False)
        assert torch.equal(session.tokens, tokens)


def test_a_run_sent_ahead_waits_for_the_run_whose_commit_it_carries() -> None:
    """See [Note: run ahead]: run 2, carrying run 1's commit, reaches a stage before run 1; it
    waits for run 1 to end there, applies its commit and trains like commit-then-run. A run
    sent ahead that is aborted while it waits ends its wait at once."""
    problem = PROBLEMS["mlp"]
    reference = Reference(
        problem, seed=3, optimizer={"name": "sgd", "lr": 0.1}, clip_grad_norm=None
    )
    pipeline = _pipeline(problem, num_stages=1)
    engine = pipeline.engines[0]
    x, y = problem.batch(8, seed=0)
    x2, y2 = problem.batch(7, seed=1)
    loss_weights = microbatch.loss_weights([len(t) for t in microbatch.split(x2, 4)])

    def second() -> RunResult:
        return engine.run_step(
            2,
            training=True,
            num_microbatches=4,
            data=RunInputs(
                inputs=microbatch.split(x2, 4),
                targets=microbatch.split(y2, 4),
                loss_weights=loss_weights,
            ),
            commit=Carried(run_id=1, grad_scale=None),
        )

    with futures.ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(second)
        time.sleep(0.2)
        assert not ahead.done() and engine.last_run_id == 0  # waiting, nothing changed
        assert all(isinstance(r, RunResult) for r in pipeline.run(x, y, run_id=1))
        result = ahead.result(timeout=10)
    reference.step(x, y)
    assert engine.runtime.step == 1 and engine.pending_commit == 2
    assert sum(result.losses) == pytest.approx(reference.step(x2, y2), rel=1e-5, abs=1e-6)
    engine.commit(2, None)
    _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())

    with futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            engine.run_step,
            4,
            training=False,
            num_microbatches=1,
            data=RunInputs(inputs=[x], targets=[], loss_weights=[]),
            commit=Carried(run_id=3, grad_scale=None),
        )
        time.sleep(0.2)
        assert not waiting.done()
        started = time.monotonic()
        engine.abort(4)
        with pytest.raises(FailedPreconditionError, match="run 4 is not after the last run 4"):
            waiting.result(timeout=10)
        assert time.monotonic() - started < 5


def test_a_commit_fault_fires_at_its_step_when_the_run_carrying_it_arrives_early(
    tmp_path: Path,
) -> None:
    """Run 3, carrying run 2's commit (step 2), reaches the stage before run 2: the fault at
    the commit of step 2 fires when that commit is applied, not at the earlier step read on
    arrival. It fails run 3 before anything changes; the retry trains like the reference."""
    problem = PROBLEMS["mlp"]
    reference = Reference(
        problem, seed=3, optimizer={"name": "sgd", "lr": 0.1}, clip_grad_norm=None
    )
    fault = FaultKill(when="commit", step=2, rank=0, marker=str(tmp_path / "fired"), action="fail")
    pipeline = _pipeline(problem, num_stages=1, fault_kill=fault)
    engine = pipeline.engines[0]
    batches = [problem.batch(8, seed=seed) for seed in range(3)]

    def data(i: int) -> RunInputs:
        x, y = batches[i]
        weights = microbatch.loss_weights([len(t) for t in microbatch.split(x, 4)])
        return RunInputs(
            inputs=microbatch.split(x, 4), targets=microbatch.split(y, 4), loss_weights=weights
        )

    def run(run_id: int) -> RunResult:
        return engine.run_step(
            run_id,
            training=True,
            num_microbatches=4,
            data=data(run_id - 1),
            commit=Carried(run_id=run_id - 1, grad_scale=None),
        )

    assert all(isinstance(r, RunResult) for r in pipeline.run(*batches[0], run_id=1))
    with futures.ThreadPoolExecutor(1) as pool:
        third = pool.submit(run, 3)
        time.sleep(0.2)
        assert not third.done() and not (tmp_path / "fired").exists()
        run(2)
        with pytest.raises(ResourceExhaustedError, match="fault injection: commit of step 2"):
            third.result(timeout=10)
    assert (engine.pending_commit, engine.last_run_id, engine.runtime.step) == (2, 2, 1)
    run(3)
    engine.commit(3, None)
    for x, y in batches:
        reference.step(x, y)
    _assert_tensors(pipeline.tensors("parameters"), reference.model.state_dict())


def test_progress_never_shows_a_commit_half_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Info's (step, newest run, pending run) come from ``progress``: during a commit's
    optimizer step it answers at once with the run still pending; once the step is counted
    but the run not yet cleared, it waits, then shows the commit done (a torn read, step 1 with
    run 1 still pending, fails the coordinator's commit check)."""
    problem = PROBLEMS["mlp"]
    pipeline = _pipeline(problem, num_stages=1)
    engine = pipeline.engines[0]
    assert all(isinstance(r, RunResult) for r in pipeline.run(*problem.batch(8, seed=0), run_id=1))
    assert engine.progress() == (0, 1, 1)
    applying, counted, go = threading.Event(), threading.Event(), threading.Event()
    apply_step, count_step = engine.runtime.apply_step, engine.runtime.count_step

    def slow_apply(grad_scale: float | None) -> None:
        apply_step(grad_scale)
        applying.set()
        go.wait(10)

    def slow_count() -> int:
        step = count_step()
        counted.set()
        go.wait(10)
        return step

    monkeypatch.setattr(engine.runtime, "apply_step", slow_apply)
    monkeypatch.setattr(engine.runtime, "count_step", slow_count)
    with futures.ThreadPoolExecutor(2) as pool:
        committing = pool.submit(engine.commit, 1, None)
        assert applying.wait(10)
        assert pool.submit(engine.progress).result(timeout=2) == (0, 1, 1)
        go.set()
        assert counted.wait(10)
    assert committing.result(timeout=10) == 1
    assert engine.progress() == (1, 1, None)

    # The torn moment itself: the step counted, the run not yet cleared.
    assert all(isinstance(r, RunResult) for r in pipeline.run(*problem.batch(8, seed=1), run_id=2))
    go.clear()
    counted.clear()
    monkeypatch.setattr(engine.runtime, "apply_step", apply_step)
    with futures.ThreadPoolExecutor(2) as pool:
        committing = pool.submit(engine.commit, 2, None)
        assert counted.wait(10)
        reading = pool.submit(engine.progress)
        time.sleep(0.2)
        assert not reading.done()
        go.set()
        assert committing.result(timeout=10) == 2
        assert reading.result(timeout=10) == (2, 2, None)


@pytest.mark.parametrize(("schedule_name", "num_stages"), [("1f1b", 3), ("zb-h1", 2), ("1f1b", 1)])
def test_a_run_sent_ahead_in_a_clipping_job_scales_by_the_norm_summed_along_the_links(
    schedule_name: str, num_stages: int
) -> None:
    """See [Note: norm along the links]: runs that carry their predecessor's commit with
    ``scale_from_links`` leave every stage with exactly the weights of runs whose commit the
    coordinator scaled from their replies, and the one-process reference's up to rounding."""
    problem = PROBLEMS["mlp"]
    optimizer = {"name": "adamw", "lr": 1e-2}
    clip = 0.05  # below the norms of these batches: every step is scaled

    def pipeline() -> Pipeline:
        return Pipeline(
            problem,
            schedule_name=schedule_name,
            num_stages=num_stages,
            seed=4,
            optimizer=optimizer,
            clip_grad_norm=clip,
        )

    batches = [problem.batch(size, seed=step) for step, size in enumerate((8, 7, 9, 8))]
    scaled, linked = pipeline(), pipeline()
    reference = Reference(problem, seed=4, optimizer=optimizer, clip_grad_norm=clip)
    losses = [scaled.train_step(x, y) for x, y in batches]
    for step, (x, y) in enumerate(batches, start=1):
        carried = Carried(run_id=step - 1, grad_scale=None, scale_from_links=True)
        results = linked.run(x, y, run_id=step, commit=carried if step > 1 else None)
        assert all(isinstance(r, RunResult) for r in results), results
        last = results[-1]
        assert isinstance(last, RunResult)
        assert float(sum(last.losses)) == losses[step - 1]
        assert float(sum(last.losses)) == pytest.approx(reference.step(x, y), rel=1e-5, abs=1e-6)
    # The last step's commit as the coordinator flushes it.
    replies = [r for r in results if isinstance(r, RunResult)]
    norm_sq = total_norm_sq([r.grad_norm_sq or 0.0 for r in replies])
    assert math.sqrt(norm_sq) > clip
    for engine in linked.engines:
        engine.commit(len(batches), clip_scale(norm_sq, clip))
    got, want = linked.tensors("parameters"), scaled.tensors("parameters")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    _assert_tensors(got, reference.model.state_dict())


def test_the_scale_from_the_links_is_refused_where_it_cannot_be_had() -> None:
    """A job that does not clip, a carried run that is not the pending one, and a norm of the
    wrong type from a neighbour each fail the run before it changes anything."""
    problem = PROBLEMS["mlp"]
    x, y = problem.batch(8, seed=0)
    plain = _pipeline(problem, num_stages=1)
    assert all(isinstance(r, RunResult) for r in plain.run(x, y, run_id=1))
    refused = plain.run(
        x, y, run_id=2, commit=Carried(run_id=1, grad_scale=None, scale_from_links=True)
    )
    assert isinstance(refused[0], FailedPreconditionError)
    assert "does not clip" in str(refused[0])
    assert plain.engines[0].pending_commit == 1 and plain.engines[0].runtime.step == 0

    clipped = _pipeline(problem, num_stages=2, clip_grad_norm=0.5)
    first, second = clipped.engines
    # Run 1 was committed with an explicit scale; run 2 is the one pending.
    clipped.train_step(x, y)
    assert all(isinstance(r, RunResult) for r in clipped.run(x, y, run_id=2))
    with pytest.raises(FailedPreconditionError, match=r"run 1 has nothing to commit \(pending: 2"):
        first.run_step(
            3,
            training=True,
            num_microbatches=4,
            data=RunInputs(inputs=microbatch.split(x, 4), targets=[], loss_weights=[]),
            commit=Carried(run_id=1, grad_scale=None, scale_from_links=True),
        )
    # A float32 total from upstream.
    clipped.mailboxes[1].put(MailKey(3, ACTIVATION, 0, NORM_PART), torch.ones(1))
    with pytest.raises(InvalidArgumentError, match="must be one float64"):
        second.run_step(
            3,
            training=True,
            num_microbatches=4,
            data=RunInputs(inputs=[], targets=microbatch.split(y, 4), loss_weights=[0.25] * 4),
            commit=Carried(run_id=2, grad_scale=None, scale_from_links=True),
        )
    assert [e.pending_commit for e in clipped.engines] == [2, 2]
    assert [e.runtime.step for e in clipped.engines] == [1, 1]


def test_a_run_waiting_for_the_total_shows_as_newest_and_ends_with_its_commits_abort() -> None:
    """The last stage got run 2, which carries run 1's commit with the scale from the links,
    but the first stage never did, so no total comes: the waiting run is this stage's newest
    (what Info reports, so a restarted coordinator aborts it), and an abort of run 1 (whose
    commit it carries) ends its wait at once instead of waiting behind its run lock."""
    problem = PROBLEMS["mlp"]
    x, y = problem.batch(8, seed=0)
    pipeline = _pipeline(problem, num_stages=2, clip_grad_norm=0.5)
    assert all(isinstance(r, RunResult) for r in pipeline.run(x, y, run_id=1))
    last = pipeline.engines[1]
    with futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            last.run_step,
            2,
            training=True,
            num_microbatches=4,
            data=RunInputs(inputs=[], targets=microbatch.split(y, 4), loss_weights=[0.25] * 4),
            commit=Carried(run_id=1, grad_scale=None, scale_from_links=True),
        )
        deadline = time.monotonic() + 10
        while last.last_run_id != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert last.last_run_id == 2 and not waiting.done()
        started = time.monotonic()
        last.abort(1)
        with pytest.raises(StepAbortedError):
            waiting.result(timeout=10)
        assert time.monotonic() - started < 5
    assert last.pending_commit is None and last.runtime.step == 0
