"""The job configuration's sections: each field in one, each checking its own fields."""

from __future__ import annotations

import dataclasses

import pytest

from pipesvc.core.config import JobConfig
from pipesvc.core.job_sections import (
    SECTIONS,
    Checkpointing,
    Numerics,
    Optimization,
    Parallelism,
    Serving,
)
from pipesvc.errors import InvalidArgumentError


def test_every_field_of_a_job_belongs_to_exactly_one_section() -> None:
    owners: dict[str, list[str]] = {}
    for section in SECTIONS:
        for f in dataclasses.fields(section):  # type: ignore[arg-type]
            owners.setdefault(f.name, []).append(section.__name__)
    config_fields = {f.name for f in dataclasses.fields(JobConfig)}
    assert set(owners) == config_fields
    assert {name: o for name, o in owners.items() if len(o) > 1} == {}


def test_sections_read_off_a_config_hold_its_values() -> None:
    config = JobConfig(
        model="gpt",
        num_stages=3,
        data_parallel=2,
        checkpoint_every=7,
        precision="bf16-mixed",
        wire_dtype={"activations": "int8", "gradients": "int8"},
        name="my-gpt",
    )
    parallel = Parallelism.of(config)
    assert (parallel.num_stages, parallel.total_stages) == (3, config.total_stages) == (3, 6)
    assert parallel.step_microbatches == config.step_microbatches == 8
    assert Checkpointing.of(config).checkpoint_every == 7
    numerics = Numerics.of(config)
    assert numerics.wire_dtype == config.wire_dtype == "int8"  # canonical in both
    assert numerics.wire_codecs == config.wire_codecs == ("int8", "int8")
    assert Serving.of(config).name == "my-gpt"
    assert Optimization.of(config).optimizer == config.optimizer


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        (Checkpointing, {"checkpoint_every": -1}, r"checkpoint_every \(-1\)"),
        (
            Serving,
            {"name": "no spaces", "prefill_chunk": None, "decode_steps": None},
            "job name 'no spaces'",
        ),
        (Numerics, {"precision": "bf16", "wire_dtype": "float16"}, "cannot send float16"),
        (Optimization, {"loss": "mse", "optimizer": {"name": "sgd"}, "clip_grad_norm": 0.0},
         r"clip_grad_norm \(0.0\)"),
    ],
)  # fmt: skip
def test_a_section_checks_its_own_fields_alone(
    section: type, values: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        section(**values)


def test_a_bad_field_of_a_config_is_named_by_its_section() -> None:
    with pytest.raises(InvalidArgumentError, match=r"data_parallel \(2\): re-planning"):
        JobConfig(model="gpt", data_parallel=2, partition="throughput")
    parallel = Parallelism.of(JobConfig(model="gpt"))
    with pytest.raises(InvalidArgumentError, match=r"num_stages \(0\)"):
        dataclasses.replace(parallel, num_stages=0)  # a changed section is checked again
