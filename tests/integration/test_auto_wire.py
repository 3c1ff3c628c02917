"""``wire_dtype="auto"`` on a real cluster whose stages are on hosts of their own: a new job
sends exact on every link; the re-planner measures (its link rates forced tiny through the
coordinator's test seam, ``PIPESVC_TEST_LINK_BYTES_PER_S``, so every link between hosts is
the bottleneck) and moves the job, at a new plan epoch between two steps, to a plan whose
links send int8 activations and bfloat16 gradients; the plan says so and why, the choice
survives a coordinator restart, and every step equals one process that applies each step's
codecs at that step's boundaries (see [Note: automatic codecs] in
pipesvc/core/link_codecs.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pipesvc
from pipesvc import models
from pipesvc.coordinator.rebalance import LINK_RATE_ENV
from pipesvc.core import quant
from pipesvc.core.link_codecs import AUTO_CODECS, Codecs, links
from pipesvc.core.microbatch import loss_weights, split
from pipesvc.core.plan import PipelineStage
from tests.support.reference import PROBLEMS, loss_fn

NUM_MICROBATCHES = 4
FORCED_BYTES_PER_S = 1000.0
"""Every measured link rate, as the coordinator will read it: 1 kB/s."""


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[pipesvc.LocalCluster]:
    monkeypatch.setenv(LINK_RATE_ENV, str(FORCED_BYTES_PER_S))  # the coordinator's children too
    with pipesvc.LocalCluster(num_stages=3, threads_per_stage=1, separate_hosts=True) as started:
        yield started


Boundaries = dict[int, Codecs]
"""Per layer that starts a stage (rank > 0): the codecs of the link into it."""


def _boundaries(job: pipesvc.Job) -> Boundaries:
    plan = sorted((s for s in job.plan if s.replica == 0), key=lambda s: s.rank)
    found = links(job.config, plan)
    return {plan[link.target].start_layer: link.codecs for link in found}


def _one_process(
    steps: list[Boundaries], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The gpt in one process, SGD over the job's micro-batches; in step ``k`` the activation
    that enters each layer of ``steps[k]`` passes through that boundary's codecs."""
    problem = PROBLEMS["gpt"]
    model = models.build(problem.model, seed=3, **problem.model_args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for boundaries, (x, y) in zip(steps, batches, strict=True):
        optimizer.zero_grad()
        total = 0.0
        xs, ys = split(x, NUM_MICROBATCHES), split(y, NUM_MICROBATCHES)
        for xm, ym, w in zip(xs, ys, loss_weights([len(t) for t in xs]), strict=True):
            out = xm
            for index, layer in enumerate(model):
                if index in boundaries:
                    out = quant.through_wire(out, *boundaries[index])
                out = layer(out)
            loss = loss_fn(problem.loss, out, ym) * w
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _describe(plan: list[PipelineStage]) -> list[tuple[int, int, str, str]]:
    return [(s.start_layer, s.end_layer, s.link_codec, s.link_reason) for s in plan]


def test_auto_compresses_the_bottleneck_links_at_a_replan_and_keeps_them(
    cluster: pipesvc.LocalCluster,
) -> None:
    problem = PROBLEMS["gpt"]
    batches = [problem.batch(8, seed=step) for step in range(6)]
    steps: list[Boundaries] = []
    losses: list[float] = []
    client = cluster.connect()
    job = client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=3,
        num_stages=3,
        num_microbatches=NUM_MICROBATCHES,
        optimizer={"name": "sgd", "lr": 0.1},
        loss=problem.loss,
        partition="uniform",
        wire_dtype="auto",
    )
    # A new job: exact on every link, nothing measured yet.
    assert [(x.between_hosts, x.codecs, x.reason) for x in job.links] == [
        (True, (None, None), "auto: exact until measured")
    ] * 2
    for x, y in batches[:2]:
        steps.append(_boundaries(job))
        losses.append(job.train_step(x, y))

    replan = job.replan("throughput")
    assert replan.moved
    assert [(x.between_hosts, x.codecs) for x in job.links] == [(True, AUTO_CODECS)] * 2
    for link in job.links:
        assert link.reason.startswith(
            "auto: int8 activations, bfloat16 gradients (the bottleneck: link 0.001 MB/s"
        ), link.reason
    assert "(auto: int8 activations, bfloat16 gradients (the bottleneck" in repr(job)
    for x, y in batches[2:4]:
        job.refresh()
        steps.append(_boundaries(job))
        losses.append(job.train_step(x, y))
    before_restart = _describe(job.refresh().plan)
    job_id = job.id
    client.close()

    cluster.restart_coordinator(kill=True)
    with cluster.connect() as client:
        job = client.get_job(job_id)
        assert _describe(job.plan) == before_restart  # the plan, codecs and reasons kept
        for x, y in batches[4:]:
            job.refresh()
            steps.append(_boundaries(job))
            losses.append(job.train_step(x, y))
        weights = job.state_dict()
        job.close()

    assert all(set(b.values()) == {(None, None)} for b in steps[:2])
    assert all(set(b.values()) == {AUTO_CODECS} for b in steps[2:])
    expected_losses, expected = _one_process(steps, batches)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # The codecs changed what the steps computed: exact all along ends elsewhere.
    _, exact = _one_process([{b: (None, None) for b in s} for s in steps], batches)
    assert any(
        not torch.allclose(weights[key], value, rtol=1e-5, atol=1e-6)
        for key, value in exact.items()
    )
