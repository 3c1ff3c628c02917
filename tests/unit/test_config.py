"""Unit tests for job configuration and its pure helpers: config, optim, loss, microbatch, plan."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from typing import Any

import pytest
import torch

from pipesvc.client import Client
from pipesvc.core.config import (
    JobConfig,
    config_from_dict,
    config_from_proto,
    config_to_dict,
    config_to_proto,
    parse_json_object,
    wire_field_name,
)
from pipesvc.core.limits import MAX_MICROBATCHES
from pipesvc.core.loss import compute_loss
from pipesvc.core.microbatch import loss_weights, split
from pipesvc.core.optim import build_optimizer
from pipesvc.core.plan import PipelineStage, check_plan
from pipesvc.errors import InvalidArgumentError
from pipesvc.stage.dataplane import mailbox
from pipesvc.v1 import common_pb2


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"model": "os.path"}, "'os.path'"),
        ({"model": "../x"}, "'../x'"),
        ({"model": ""}, "''"),
        ({"model_args": {"width": object()}}, "'width'"),
        ({"num_stages": 0}, "num_stages (0)"),
        ({"num_stages": True}, "num_stages must be an int; got True"),
        ({"num_stages": 2.0}, "num_stages must be an int; got 2.0"),
        ({"num_microbatches": 0}, "num_microbatches (0)"),
        ({"prefill_chunk": -1}, "prefill_chunk (-1)"),
        ({"prefill_chunk": 2**21}, "prefill_chunk (2097152) must be in [0, 2**20]"),
        ({"decode_steps": 0}, "decode_steps (0) must be in [1, 64]"),
        ({"decode_steps": 65}, "decode_steps (65) must be in [1, 64]"),
        ({"prefill_chunk": 1.5}, "prefill_chunk must be an int; got 1.5"),
        ({"seed": -1}, "seed (-1)"),
        ({"schedule": "interleaved"}, "'interleaved'"),
        ({"partition": "random"}, "'random'"),
        ({"loss": "hinge"}, "'hinge'"),
        ({"optimizer": {"name": "lbfgs"}}, "'lbfgs'"),
        ({"optimizer": {"lr": 0.1}}, "None"),
        ({"optimizer": {"name": ["sgd"]}}, "['sgd']"),
        ({"optimizer": {"name": "sgd", "betas": [0.9, 0.9]}}, "'betas'"),
        ({"optimizer": {"name": "adam", "lr": {"value": 1}}}, "'lr'"),
        ({"optimizer": {"name": "adam", "betas": [0.9, object()]}}, "'betas'"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm (0.0)"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm (-1.0)"),
        ({"clip_grad_norm": math.nan}, "clip_grad_norm (nan)"),
        ({"clip_grad_norm": math.inf}, "clip_grad_norm (inf)"),
        ({"clip_grad_norm": "1.0"}, "clip_grad_norm ('1.0')"),
        ({"input_shape": (8, 0)}, "input_shape (8, 0)"),
        ({"input_shape": [8, 16]}, "input_shape [8, 16]"),
        ({"input_shape": ()}, "input_shape ()"),
        ({"input_shape": (2,) * 9}, "1 to 8"),
        ({"input_shape": (2**30, 2**30)}, "2**40"),
        ({"input_dtype": "complex64"}, "input_dtype 'complex64'"),
    ],
    ids=repr,
)
def test_job_config_rejects_bad_fields(overrides: dict[str, Any], named: str) -> None:
    fields: dict[str, Any] = {"model": "mlp", **overrides}
    with pytest.raises(InvalidArgumentError) as info:
        JobConfig(**fields)
    assert named in str(info.value)


def test_job_config_accepts_its_limits() -> None:
    config = JobConfig(
        model="gpt", num_stages=1024, num_microbatches=MAX_MICROBATCHES, seed=2**63 - 1
    )
    assert config.num_stages == 1024
    with pytest.raises(InvalidArgumentError, match="1025"):
        JobConfig(model="gpt", num_stages=1025)


def test_the_microbatch_limit_is_one_number_everywhere() -> None:
    # The config refuses one micro-batch more than the stages and their mailboxes are sized
    # for (tests/unit/test_mailbox.py fills a mailbox with the largest run), plus a run's
    # norm mail.
    assert mailbox.MAX_ITEMS == 3 * MAX_MICROBATCHES + 2
    too_many = MAX_MICROBATCHES + 1
    with pytest.raises(InvalidArgumentError, match=rf"\({too_many}\).*{MAX_MICROBATCHES}"):
        JobConfig(model="mlp", num_microbatches=too_many)


@pytest.mark.parametrize(
    ("clip_grad_norm", "input_shape"), [(None, None), (0.5, (8, 128)), (2, (4, 3, 32, 32))]
)
def test_config_proto_round_trip(
    clip_grad_norm: float | None, input_shape: tuple[int, ...] | None
) -> None:
    config = JobConfig(
        model="gpt",
        model_args={"num_layers": 3, "sizes": [4, 8], "nested": {"a": None}},
        seed=11,
        num_stages=3,
        num_microbatches=6,
        schedule="gpipe",
        optimizer={"name": "adam", "lr": 0.01, "betas": [0.8, 0.9]},
        loss="mse",
        partition="uniform",
        clip_grad_norm=clip_grad_norm,
        input_shape=input_shape,
        input_dtype="int64" if input_shape else "float32",
    )
    assert config_from_dict(config_to_dict(config)) == config
    spec = config_to_proto(config)
    assert spec.HasField("clip_grad_norm") == (clip_grad_norm is not None)
    wire = type(spec).FromString(spec.SerializeToString())
    assert config_from_proto(wire) == config


NON_DEFAULT: dict[str, Any] = {
    "model": "gpt",
    "model_args": {"num_layers": 3, "sizes": [4, 8], "nested": {"a": None}},
    "seed": 2**63 - 1,
    "num_stages": 5,
    "num_microbatches": 7,
    "schedule": "gpipe",
    "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
    "loss": "mse",
    "partition": "memory",
    "clip_grad_norm": 0.25,
    "checkpoint_every": 0,
    "input_shape": (2, 3, 4),
    "input_dtype": "bfloat16",
    "precision": "bf16-mixed",
    "trainable": ("*.mlp.*", "lm_head.*"),
    "rebalance": False,  # a replicated job cannot re-plan: see the test below
    "wire_dtype": "bfloat16",
    "data_parallel": 3,
    "min_replicas": 2,
    "virtual_stages": 1,  # needs an interleaving schedule: see the test below
    "name": "org/my-llama_v1.2",
    "prefill_chunk": 0,  # off: survives as 0, not as the default
    "decode_steps": 1,
}
"""A value for every JobConfig field, none of them the default."""


def test_every_field_survives_the_dict_and_the_wire() -> None:
    names = [f.name for f in dataclasses.fields(JobConfig)]
    assert sorted(NON_DEFAULT) == sorted(names), "give every JobConfig field a value above"
    config = JobConfig(**NON_DEFAULT)
    defaults = JobConfig(model="mlp")
    assert [n for n in names if getattr(config, n) == getattr(defaults, n)] == [
        "rebalance",
        "virtual_stages",
    ]
    rebalancing = {**NON_DEFAULT, "rebalance": True, "data_parallel": 1, "min_replicas": None}
    interleaved = {
        **NON_DEFAULT,
        "schedule": "interleaved-1f1b",
        "virtual_stages": 3,
        "partition": "uniform",
    }
    for each in (config, JobConfig(**rebalancing), JobConfig(**interleaved)):
        as_dict = config_to_dict(each)
        assert list(as_dict) == names
        assert config_from_dict(json.loads(json.dumps(as_dict))) == each
        wire = common_pb2.JobSpec.FromString(config_to_proto(each).SerializeToString())
        assert config_from_proto(wire) == each


def test_every_field_has_its_place_in_the_wire_job_spec() -> None:
    """A field added to JobConfig without a JobSpec field (or the reverse) fails here."""
    wire_names = set(common_pb2.JobSpec.DESCRIPTOR.fields_by_name)
    carried = {wire_field_name(f.name) for f in dataclasses.fields(JobConfig)}
    assert sorted(carried - wire_names) == [], "add these to JobSpec in common.proto"
    assert sorted(wire_names - carried) == [], "JobSpec fields that JobConfig lacks"


def test_the_dict_and_wire_forms_are_unchanged() -> None:
    """Rows saved in the state database and specs of older clients must still load."""
    saved_row = {
        "model": "gpt",
        "model_args": {"vocab_size": 17},
        "seed": 3,
        "num_stages": 2,
        "num_microbatches": 4,
        "schedule": "1f1b",
        "optimizer": {"name": "adamw", "lr": 0.001},
        "loss": "cross_entropy",
        "partition": "parameters",
        "clip_grad_norm": 1.0,
        "checkpoint_every": 10,
        "input_shape": [8, 64],
        "input_dtype": "int64",
    }
    config = config_from_dict(saved_row)  # a row saved before ``precision`` existed
    assert config == JobConfig(
        model="gpt",
        model_args={"vocab_size": 17},
        seed=3,
        clip_grad_norm=1.0,
        checkpoint_every=10,
        input_shape=(8, 64),
        input_dtype="int64",
    )
    newer = {
        "trainable": None,
        "precision": "fp32",
        "rebalance": False,
        "wire_dtype": None,
        "data_parallel": 1,
        "min_replicas": None,
        "virtual_stages": 1,
        "name": None,
        "prefill_chunk": None,
        "decode_steps": None,
    }  # fields added since
    assert config_to_dict(config) == {**saved_row, **newer}
    old_defaults = {**saved_row, "clip_grad_norm": None, "input_shape": None}
    assert config_to_dict(config_from_dict(old_defaults)) == {**old_defaults, **newer}
    spec = common_pb2.JobSpec(
        model="gpt",
        model_args_json='{"vocab_size": 17}',
        seed=3,
        num_stages=2,
        num_microbatches=4,
        schedule="1f1b",
        optimizer_json='{"lr": 0.001, "name": "adamw"}',
        loss="cross_entropy",
        partition="parameters",
        clip_grad_norm=1.0,
        checkpoint_every=10,
        input_shape=[8, 64],
        input_dtype="int64",
        precision="fp32",
        data_parallel=1,
        virtual_stages=1,
    )
    assert config_to_proto(config) == spec
    assert config_from_proto(spec) == config
    older_client = common_pb2.JobSpec()
    older_client.CopyFrom(spec)
    for name in (
        "clip_grad_norm",
        "input_shape",
        "input_dtype",
        "precision",
        "trainable",
        "data_parallel",
        "virtual_stages",
    ):
        older_client.ClearField(name)
    loaded = config_from_proto(older_client)
    assert loaded == dataclasses.replace(
        config, clip_grad_norm=None, input_shape=None, input_dtype="float32"
    )


def test_create_job_defaults_are_the_config_defaults() -> None:
    """``Client.create_job`` spells out every field for its users; its defaults must not drift."""
    parameters = inspect.signature(Client.create_job).parameters
    for f in dataclasses.fields(JobConfig):
        assert f.name in parameters, f"Client.create_job lacks {f.name}"
        default = parameters[f.name].default
        if f.default is not dataclasses.MISSING:
            assert default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            # None stands for the factory's value, or the default is that value itself.
            assert default is None or default == f.default_factory(), f.name
        else:
            assert default is inspect.Parameter.empty, f.name


def test_config_from_proto_validates() -> None:
    spec = config_to_proto(JobConfig(model="mlp"))
    spec.optimizer_json = '{"name": "adamw", "params": 1}'
    with pytest.raises(InvalidArgumentError, match="'params'"):
        config_from_proto(spec)
    spec.optimizer_json = "[1]"
    with pytest.raises(InvalidArgumentError, match="optimizer_json"):
        config_from_proto(spec)


@pytest.mark.parametrize(
    ("text", "named"),
    [("[1, 2]", "got list"), ('"x"', "got str"), ("3", "got int"), ("null", "got NoneType")],
)
def test_parse_json_object_rejects_non_objects(text: str, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"model_args_json must be .*{named}"):
        parse_json_object(text, "model_args_json")


@pytest.mark.parametrize("text", ["{", "{'a': 1}", "{} x", "[" * 100_000])
def test_parse_json_object_rejects_bad_json(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="optimizer_json is not valid JSON"):
        parse_json_object(text, "optimizer_json")


def test_parse_json_object_accepts_objects_and_empty() -> None:
    assert parse_json_object('{"a": [1, {"b": 2}]}', "f") == {"a": [1, {"b": 2}]}
    assert parse_json_object("", "f") == {}


@pytest.mark.parametrize(
    ("spec", "cls", "expected"),
    [
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, torch.optim.SGD, {"momentum": 0.9}),
        (
            {"name": "adam", "lr": 0.01, "betas": [0.5, 0.6]},
            torch.optim.Adam,
            {"betas": (0.5, 0.6)},
        ),
        (
            {"name": "adamw", "lr": 0.02, "weight_decay": 0.3},
            torch.optim.AdamW,
            {"weight_decay": 0.3},
        ),
    ],
)
def test_build_optimizer(spec: dict[str, Any], cls: type, expected: dict[str, Any]) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = build_optimizer(spec, [param])
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert group["params"] == [param]
    assert group["lr"] == spec["lr"]
    for name, value in expected.items():
        assert group[name] == value
    param.grad = torch.ones(3)
    optimizer.step()
    assert bool((param.detach() < 1).all())


def test_build_optimizer_maps_torch_value_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="optimizer sgd"):
        build_optimizer({"name": "sgd", "lr": -1.0}, [torch.nn.Parameter(torch.ones(1))])


@pytest.mark.parametrize(("batch", "num_microbatches"), [(8, 4), (10, 4), (7, 3), (5, 5), (9, 1)])
def test_split_sizes_and_content(batch: int, num_microbatches: int) -> None:
    inputs = torch.randn(batch, 3, generator=torch.Generator().manual_seed(batch))
    chunks = split(inputs, num_microbatches)
    sizes = [chunk.shape[0] for chunk in chunks]
    assert len(chunks) == num_microbatches
    assert sum(sizes) == batch
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert all(chunk.is_contiguous() for chunk in chunks)
    torch.testing.assert_close(torch.cat(chunks), inputs, rtol=0, atol=0)


def test_split_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"batch size \(3\).*num_microbatches \(4\)"):
        split(torch.zeros(3, 2), 4)
    with pytest.raises(InvalidArgumentError, match="scalar"):
        split(torch.tensor(1.0), 1)


@pytest.mark.parametrize("sizes", [[4, 4], [3, 3, 2, 2], [1], [5, 4, 4]])
def test_loss_weights_sum_to_one_in_proportion(sizes: list[int]) -> None:
    weights = loss_weights(sizes)
    assert math.isclose(sum(weights), 1.0)
    for weight, size in zip(weights, sizes, strict=True):
        assert math.isclose(weight * sum(sizes), size)


@pytest.mark.parametrize("num_microbatches", [1, 3, 4])
def test_weighted_microbatch_losses_equal_whole_batch_loss(num_microbatches: int) -> None:
    gen = torch.Generator().manual_seed(num_microbatches)
    cases = [
        ("mse", torch.randn(10, 5, generator=gen), torch.randn(10, 5, generator=gen)),
        (
            "cross_entropy",
            torch.randn(10, 6, 7, generator=gen),  # (B, T, V) logits
            torch.randint(0, 7, (10, 6), generator=gen),
        ),
    ]
    for name, output, target in cases:
        outputs, targets = split(output, num_microbatches), split(target, num_microbatches)
        weights = loss_weights([chunk.shape[0] for chunk in outputs])
        total = sum(
            w * compute_loss(name, o, t) for w, o, t in zip(weights, outputs, targets, strict=True)
        )
        whole = compute_loss(name, output, target)
        assert isinstance(total, torch.Tensor)
        torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)


def test_compute_loss_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"\[4, 2\].*\[4, 3\]"):
        compute_loss("mse", torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(InvalidArgumentError, match=r"torch\.float32"):
        compute_loss("cross_entropy", torch.zeros(4, 3), torch.zeros(4))
    with pytest.raises(InvalidArgumentError, match=r"\[4, 3\].*\[5\]"):
        compute_loss("cross_entropy", torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match="'l1'"):
        compute_loss("l1", torch.zeros(1), torch.zeros(1))


def stages(*bounds: tuple[int, int]) -> list[PipelineStage]:
    return [PipelineStage(start_layer=s, end_layer=e, rank=r) for r, (s, e) in enumerate(bounds)]


def test_check_plan_accepts_a_covering_plan() -> None:
    check_plan(stages((0, 2), (2, 3), (3, 7)), num_layers=7)
    check_plan(stages((0, 1)), num_layers=1)


@pytest.mark.parametrize(
    ("plan", "named"),
    [
        (stages((0, 2), (3, 5)), "[3, 5)"),  # gap
        (stages((0, 3), (2, 5)), "[2, 5)"),  # overlap
        (stages((1, 5)), "[1, 5)"),  # does not start at 0
        (stages((0, 2), (2, 2), (2, 5)), "[2, 2)"),  # empty stage
        (stages((0, 2), (2, 4)), "4 layers of 5"),  # short coverage
        (stages((0, 3), (3, 6)), "6 layers of 5"),  # too long
        ([], "0 layers of 5"),
        (
            [
                PipelineStage(start_layer=0, end_layer=2, rank=1),
                PipelineStage(start_layer=2, end_layer=5, rank=0),
            ],
            "rank 1",
        ),
    ],
)
def test_check_plan_rejects(plan: list[PipelineStage], named: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        check_plan(plan, num_layers=5)
    assert named in str(info.value)


@pytest.mark.parametrize("bad", [(), ("",), ("x" * 257,), ["*.mlp.*"], (3,)])
def test_trainable_patterns_are_checked(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"trainable .* must be 1 to 256 glob patterns"):
        JobConfig(model="mlp", trainable=bad)  # type: ignore[arg-type]
