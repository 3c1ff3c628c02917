"""``wire_dtype``: activations and gradients cross the links between hosts in bfloat16,
float16, int8 or int4, one codec or one per role, links on one host stay exact, and training
equals one process that applies the same codecs at the same stage boundaries (see [Note: wire
dtype] in pipesvc/stage/compute/runtime.py and [Note: codecs per link] in
pipesvc/core/link_codecs.py). The stages of ``hosts`` listen on loopback addresses of their own, so
their links count as links between hosts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pipesvc
from pipesvc import models
from pipesvc.core import quant
from pipesvc.core.config import config_from_dict, config_from_proto, config_to_dict, config_to_proto
from pipesvc.core.link_codecs import Link
from pipesvc.core.microbatch import loss_weights, split
from tests.support.reference import PROBLEMS, loss_fn

NUM_MICROBATCHES = 4
STEPS = 3


@pytest.fixture(scope="module")
def hosts() -> Iterator[pipesvc.Client]:
    with (
        pipesvc.LocalCluster(num_stages=3, threads_per_stage=1, separate_hosts=True) as cluster,
        pipesvc.connect(cluster.address, timeout_s=120) as connected,
    ):
        yield connected


def _train(
    client: pipesvc.Client,
    wire: str | dict[str, str | None],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], dict[str, torch.Tensor], list[Link], set[int]]:
    problem = PROBLEMS["gpt"]
    with client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=3,
        num_stages=3,
        num_microbatches=NUM_MICROBATCHES,
        optimizer={"name": "sgd", "lr": 0.1},
        loss=problem.loss,
        partition="uniform",
        wire_dtype=wire,
    ) as job:
        losses = [job.train_step(x, y) for x, y in batches]
        return losses, job.state_dict(), job.links, {s.start_layer for s in job.plan[1:]}


def _one_process(
    wire: tuple[str | None, str | None],
    boundaries: set[int],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The gpt in one process, SGD over the job's micro-batches, each activation that leaves
    layer ``i - 1`` for a boundary ``i`` passed through ``wire``'s codecs (activations,
    gradients)."""
    problem = PROBLEMS["gpt"]
    model = models.build(problem.model, seed=3, **problem.model_args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        total = 0.0
        xs, ys = split(x, NUM_MICROBATCHES), split(y, NUM_MICROBATCHES)
        for xm, ym, w in zip(xs, ys, loss_weights([len(t) for t in xs]), strict=True):
            out = xm
            for index, layer in enumerate(model):
                if index in boundaries:
                    out = quant.through_wire(out, *wire)
                out = layer(out)
            loss = loss_fn(problem.loss, out, ym) * w
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


CODECS: list[str | dict[str, str | None]] = [
    "bfloat16",
    "float16",
    "int8",
    "int4",
    {"activations": "int8", "gradients": "bfloat16"},
    {"activations": "int4"},
    {"gradients": "int8"},
]


@pytest.mark.parametrize("wire", CODECS, ids=str)
def test_training_equals_one_process_with_the_same_codecs_between_hosts(
    hosts: pipesvc.Client, wire: str | dict[str, str | None]
) -> None:
    batches = [PROBLEMS["gpt"].batch(8, seed=step) for step in range(STEPS)]
    losses, weights, links, boundaries = _train(hosts, wire, batches)
    codecs = (
        (wire, wire) if isinstance(wire, str) else (wire.get("activations"), wire.get("gradients"))
    )
    assert [(link.between_hosts, link.codecs) for link in links] == [(True, codecs)] * 2
    expected_losses, expected = _one_process(codecs, boundaries, batches)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # The casts happened: without them, one process ends elsewhere.
    _, uncast = _one_process((None, None), boundaries, batches)
    assert any(
        not torch.allclose(weights[key], value, rtol=1e-5, atol=1e-6)
        for key, value in uncast.items()
    )


def test_links_on_one_host_stay_exact(client: pipesvc.Client) -> None:
    batches = [PROBLEMS["gpt"].batch(8, seed=step) for step in range(STEPS)]
    losses, weights, links, boundaries = _train(client, "int4", batches)
    assert [(link.between_hosts, link.codecs) for link in links] == [(False, (None, None))] * 2
    expected_losses, expected = _one_process((None, None), boundaries, batches)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_wire_dtype_is_checked() -> None:
    with pytest.raises(pipesvc.InvalidArgumentError, match="wire_dtype 'int3' is not supported"):
        pipesvc.JobConfig(model="mlp", wire_dtype="int3")
    with pytest.raises(pipesvc.InvalidArgumentError, match="no role 'weights'"):
        pipesvc.JobConfig(model="mlp", wire_dtype={"weights": "int8"})
    with pytest.raises(pipesvc.InvalidArgumentError, match="codec 'fp8' is not supported"):
        pipesvc.JobConfig(model="mlp", wire_dtype={"activations": "fp8"})
    with pytest.raises(pipesvc.InvalidArgumentError, match="cannot send float16"):
        pipesvc.JobConfig(model="mlp", wire_dtype="float16", precision="bf16-mixed")
    with pytest.raises(pipesvc.InvalidArgumentError, match="cannot send float16"):
        pipesvc.JobConfig(model="mlp", wire_dtype={"gradients": "float16"}, precision="bf16")


def test_wire_dtype_per_role_is_kept_in_one_text_form_that_round_trips() -> None:
    config = pipesvc.JobConfig(model="mlp", wire_dtype={"activations": "int8"})
    assert config.wire_dtype == "activations=int8,gradients=exact"
    assert config.wire_codecs == ("int8", None)
    assert config_from_proto(config_to_proto(config)) == config
    assert config_from_dict(config_to_dict(config)) == config
    same = pipesvc.JobConfig(model="mlp", wire_dtype={"activations": "int4", "gradients": "int4"})
    assert same.wire_dtype == "int4"
    mixed = pipesvc.JobConfig(model="mlp", wire_dtype={"activations": "int8"}, precision="bf16")
    assert mixed.wire_codecs == ("int8", "bfloat16")  # the bf16 precisions never send float32
