"""Runs of several decode steps on the stages (see [Note: decode steps on the stages] in
pipesvc.coordinator.session): which runs the coordinator plans so, what a stage accepts, and
each step's side inputs. The tokens themselves are checked against runs of one step and the
model in one process in test_engine.py (in-process stages) and test_generation.py and
test_hf_families.py (real stages)."""

from __future__ import annotations

import pytest
import torch

from pipesvc.coordinator.session import ModelSupport, Session, plan_step
from pipesvc.core.microbatch import DECODE_SIDE_INPUTS
from pipesvc.core.sampling import (
    GENERATOR_STATE_BYTES,
    RowsSampling,
    Sampling,
    choose_rows,
    generator_from,
    generator_state,
)
from pipesvc.errors import InternalError, InvalidArgumentError
from pipesvc.stage import run_request
from pipesvc.stage.compute.action_loop import _step_side
from pipesvc.v1 import common_pb2, stage_pb2

SUPPORT = ModelSupport(
    kv_cache=True, side_inputs=("attention_mask", "position_ids"), fuses_caches=True
)


def _decoding(rows: int = 1, sampling: Sampling | None = None, parts: int = 1) -> Session:
    """A session past its prompt's run: its next step extends its caches by one position."""
    session = Session(
        torch.ones(rows, 3, dtype=torch.long),
        None,
        parts=parts,
        sampling=sampling or Sampling(),
        support=SUPPORT,
    )
    logits = torch.zeros(rows, 8)
    logits[:, 4] = 9.0
    session.advance([logits], 1)
    assert session.decodes(1)
    return session


def test_decoding_sessions_run_up_to_the_steps_asked_in_one_run() -> None:
    a, b = _decoding(), _decoding(rows=2, parts=2)
    run = plan_step([a, b], 1, fuse=True, steps=4)
    assert run.batch.decode_steps == 4 and run.batch.greedy
    assert len(run.batch.inputs) == 1  # one fused micro-batch
    # Every part adds a position a step.
    assert [r.positions for r in run.batch.caches[0]] == [4, 4, 4]
    # The last stage's [steps, rows] tokens: each session's rows, step by step.
    tokens = torch.arange(12).view(4, 3)
    steps = run.steps([tokens])
    assert [[p.tolist() for p in step] for step in steps[0]] == [[[0]], [[3]], [[6]], [[9]]]
    assert [[p.tolist() for p in step] for step in steps[1]] == [
        [[1], [2]],
        [[4], [5]],
        [[7], [8]],
        [[10], [11]],
    ]
    # A last stage that ran one step (built before decode steps) is named, not misread.
    with pytest.raises(InternalError, match=r"returned \[\[3\]\] for a run of 4 decode steps"):
        run.steps([torch.arange(3)])
    # One session alone, unfused (its one part is its own micro-batch), takes the steps too.
    assert plan_step([_decoding()], 1, fuse=False, steps=3).batch.decode_steps == 3


def test_a_run_takes_one_step_unless_every_part_decodes_in_one_micro_batch() -> None:
    prompt = Session(
        torch.ones(1, 5, dtype=torch.long), None, parts=1, sampling=Sampling(), support=SUPPORT
    )
    cases = {
        "a prompt beside": [_decoding(), prompt],
        "two parts unfused": [_decoding(rows=2, parts=2)],
    }
    for what, sessions in cases.items():
        run = plan_step(sessions, 1, fuse=what != "two parts unfused", steps=4)
        assert run.batch.decode_steps == 1, what
        assert all(r.positions == 1 for r in run.batch.caches[-1] if not r.fresh), what
    asking = _decoding()
    asking.logprobs = 2  # log-probabilities need the logits of every step
    assert plan_step([asking], 1, fuse=True, steps=4).batch.decode_steps == 1


def test_sampling_sessions_send_the_last_stage_their_rows_settings_and_generators() -> None:
    """See [Note: sampling on the last stage]."""
    settings = Sampling(temperature=0.7, top_k=3, seed=1)
    sampled, greedy = _decoding(rows=2, parts=2, sampling=settings), _decoding()
    run = plan_step([greedy, sampled], 1, fuse=True, steps=4)
    assert run.batch.decode_steps == 4 and not run.batch.greedy
    first, second = run.batch.sampling
    assert (first.rows, first.sampling, first.state) == (((0, 1),), Sampling(), b"")
    assert second.rows == ((1, 2), (2, 3)) and second.sampling == settings
    assert second.state == generator_state(sampled.generator)
    # Greedy sessions alone need none.
    assert plan_step([greedy], 1, fuse=True, steps=4).batch.sampling == []


def test_the_last_stage_draws_each_sessions_rows_at_once_with_its_generator() -> None:
    """``choose_rows`` gives what the coordinator's ``Sampling.choose`` gives on each
    session's rows joined in its parts' order, and leaves each generator where it would."""
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    hot = Sampling(temperature=1.5, seed=4)
    plans = [
        RowsSampling(((3, 5), (0, 1)), hot, generator_state(hot.generator())),
        RowsSampling(((1, 3),), Sampling()),
    ]
    generators = [generator_from(plans[0].state), None]
    chosen = choose_rows(logits, plans, generators)
    mine = hot.generator()
    want = hot.choose(torch.cat([logits[3:5], logits[0:1]]), mine)
    assert chosen[[3, 4, 0]].tolist() == want.tolist()
    assert chosen[1:3].tolist() == logits[1:3].argmax(-1).tolist()
    assert generator_state(generators[0]) == generator_state(mine)


def _request(**fields: object) -> tuple[stage_pb2.RunStepRequest, list]:
    """A valid run of 3 decode steps on a first stage, with ``fields`` changed."""
    header = common_pb2.TensorHeader(dtype=common_pb2.INT64, shape=[2, 1], num_bytes=16)
    base: dict[str, object] = {
        "job_id": "j",
        "plan_epoch": 1,
        "run_id": 2,
        "mode": stage_pb2.GENERATE,
        "num_microbatches": 1,
        "greedy": True,
        "decode_steps": 3,
        "inputs": [common_pb2.Tensor(header=header)],
        "side_inputs": [
            stage_pb2.SideInputs(tensors={"attention_mask": common_pb2.Tensor(header=header)})
        ],
        "caches": [
            stage_pb2.MicrobatchCaches(
                refs=[
                    stage_pb2.CacheRef(session="a", part=0, rows=1, positions=3),
                    stage_pb2.CacheRef(session="b", part=0, rows=1, positions=3),
                ]
            )
        ],
    }
    base.update(fields)
    request = stage_pb2.RunStepRequest(**base)  # type: ignore[arg-type]
    return request, run_request.cache_refs(request, request.num_microbatches, True)


def test_a_stage_takes_the_steps_of_a_greedy_run_of_one_decoding_micro_batch() -> None:
    request, caches = _request()
    assert run_request.decode_steps(request, caches, first=True, last=True) == 3
    one = stage_pb2.MicrobatchCaches(
        refs=[stage_pb2.CacheRef(session="a", part=0, rows=1, positions=1)]
    )
    request, caches = _request(decode_steps=0, caches=[one])  # none asked: one step
    assert run_request.decode_steps(request, caches, first=True, last=True) == 1


@pytest.mark.parametrize(
    "fields",
    [
        {
            "decode_steps": 65,
            "caches": [
                stage_pb2.MicrobatchCaches(
                    refs=[stage_pb2.CacheRef(session="a", part=0, rows=1, positions=65)]
                )
            ],
        },
        {"greedy": False},
        {"mode": stage_pb2.INFER, "caches": []},
        {
            "caches": [
                stage_pb2.MicrobatchCaches(
                    refs=[stage_pb2.CacheRef(session="a", part=0, rows=1, positions=2)]
                )
            ]
        },
        {
            "caches": [
                stage_pb2.MicrobatchCaches(
                    refs=[stage_pb2.CacheRef(session="a", part=0, fresh=True, rows=1, positions=3)]
                )
            ]
        },
        {
            "side_inputs": [
                stage_pb2.SideInputs(
                    tensors={"token_type_ids": common_pb2.Tensor(header=common_pb2.TensorHeader())}
                )
            ]
        },
        {
            "inputs": [
                common_pb2.Tensor(
                    header=common_pb2.TensorHeader(
                        dtype=common_pb2.INT64, shape=[2, 2], num_bytes=32
                    )
                )
            ]
        },
    ],
    ids=["too many", "sampled", "not generating", "positions", "fresh", "side", "inputs"],
)
def test_a_stage_refuses_steps_a_run_cannot_take(fields: dict[str, object]) -> None:
    request, caches = _request(**fields)
    with pytest.raises(InvalidArgumentError, match=r"decode_steps \(\d+\) must be at most 64"):
        run_request.decode_steps(request, caches, first=True, last=True)


def _entry(rows: list[tuple[int, int]], **fields: object) -> stage_pb2.StepSampling:
    state = generator_state(torch.Generator().manual_seed(1))
    base: dict[str, object] = {"temperature": 0.8, "top_k": 4, "generator_state": state}
    base.update(fields)
    ranges = [stage_pb2.RowRange(start=a, end=b) for a, b in rows]
    return stage_pb2.StepSampling(rows=ranges, **base)  # type: ignore[arg-type]


def test_the_last_stage_takes_each_sessions_sampling() -> None:
    entries = [_entry([(1, 2)]), _entry([(0, 1)], temperature=0.0, top_k=0, generator_state=b"")]
    request, caches = _request(greedy=False, sampling=entries)
    assert run_request.decode_steps(request, caches, first=True, last=True) == 3
    plans = run_request.step_sampling(request, caches, 3)
    assert [p.rows for p in plans] == [((1, 2),), ((0, 1),)]
    assert plans[0].sampling == Sampling(temperature=0.8, top_k=4)
    assert plans[1].sampling.greedy and plans[1].state == b""
    # Only the last stage picks tokens: the others run the steps without the sampling.
    bare, caches = _request(greedy=False)
    assert run_request.decode_steps(bare, caches, first=True, last=False) == 3


@pytest.mark.parametrize(
    ("entries", "steps", "message"),
    [
        ([_entry([(0, 2)])], 1, "in a run of one step"),
        ([_entry([(0, 2)], temperature=-1.0)], 3, r"temperature \(-1.0\)"),
        ([_entry([(0, 2)], top_p=1.5)], 3, r"top_p \(1.5\)"),
        (
            [_entry([(0, 2)], generator_state=b"x" * 7)],
            3,
            f"generator state of 7 bytes; expected {GENERATOR_STATE_BYTES}",
        ),
        ([_entry([(0, 1)])], 3, r"must cover the micro-batch's 2 rows"),
        ([_entry([(0, 1)]), _entry([(0, 2)])], 3, "must cover"),
        ([_entry([(0, 2)], temperature=0.0, top_k=0)], 3, "greedy session's sampling carries"),
    ],
    ids=["one step", "temperature", "top_p", "state", "uncovered", "twice", "greedy state"],
)
def test_the_last_stage_refuses_sampling_that_does_not_fit(
    entries: list[stage_pb2.StepSampling], steps: int, message: str
) -> None:
    request, caches = _request(greedy=False, sampling=entries)
    with pytest.raises(InvalidArgumentError, match=message):
        run_request.step_sampling(request, caches, steps)


def test_a_fused_micro_batch_of_several_steps_must_add_them_to_every_part() -> None:
    mixed = stage_pb2.MicrobatchCaches(
        refs=[
            stage_pb2.CacheRef(session="a", part=0, rows=1, positions=3),
            stage_pb2.CacheRef(session="b", part=0, rows=1, positions=1),
        ]
    )
    with pytest.raises(InvalidArgumentError, match=r"all extending by 3 position"):
        _request(caches=[mixed])


def test_each_steps_side_inputs_follow_from_the_first_steps() -> None:
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    positions = torch.tensor([[1], [2]])
    first = {"attention_mask": mask, "position_ids": positions}
    assert _step_side(first, 0) is first
    third = _step_side(first, 2)
    assert torch.equal(third["attention_mask"], torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    assert torch.equal(third["position_ids"], torch.tensor([[3], [4]]))
    assert set(first) == DECODE_SIDE_INPUTS
