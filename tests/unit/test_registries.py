"""Unit tests for the generic registry, the schedule and partition registries built on it, and the
plan entry's conversions."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipesvc.cli import build_parser
from pipesvc.core import schedule, schedule_sim
from pipesvc.core.config import JobConfig
from pipesvc.core.plan import PipelineStage, plan_from_dicts, plan_to_dicts
from pipesvc.core.planning import partition
from pipesvc.core.planning.placement import check_schedule
from pipesvc.core.schedule import Action, ActionKind
from pipesvc.errors import InternalError, InvalidArgumentError, NotFoundError, UnknownModelError
from pipesvc.models import registry as model_registry
from pipesvc.name_registry import Registry

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def scratch_registries() -> Iterator[None]:
    """Registrations made by a test vanish after it (the registries are process-wide)."""
    with schedule._SCHEDULES.scratch(), partition._PARTITIONS.scratch():
        yield


def lifo_gpipe(*, rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """All forwards, then the backwards newest first: valid, and different from gpipe."""
    m = num_microbatches
    forwards = [Action(ActionKind.FORWARD, i) for i in range(m)]
    return forwards + [Action(ActionKind.BACKWARD, i) for i in reversed(range(m))]


def cyclic(*, rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Deadlocks for p, m >= 2: rank 0 wants B0 back before sending F1, while the last rank
    runs B1 (which needs F1) before B0."""
    m = num_microbatches
    if rank < num_stages - 1:
        return [
            Action(kind, i) for i in range(m) for kind in (ActionKind.FORWARD, ActionKind.BACKWARD)
        ]
    return lifo_gpipe(rank=rank, num_stages=num_stages, num_microbatches=m)


def one() -> int:
    return 1


def two() -> int:
    return 2


def fresh_registry() -> Registry[Any]:
    return Registry("widget", re.compile(r"[a-z]{1,8}"), rule="one to eight letters")


def test_registry_keeps_registration_order_and_returns_the_value() -> None:
    widgets = fresh_registry()
    assert widgets.register("zeta", two) is two
    assert widgets.register("alpha", one) is one
    assert widgets.names() == ("zeta", "alpha")
    assert widgets.get("alpha") is one
    assert widgets.get("zeta") is two


@pytest.mark.parametrize("bad", ["", "Upper", "a-b", "toolongname", None, 3])
def test_registry_refuses_names_off_its_pattern(bad: Any) -> None:
    widgets = fresh_registry()
    with pytest.raises(InvalidArgumentError) as info:
        widgets.register(bad, one)
    assert str(info.value) == (
        f"widget name {bad!r} must match '[a-z]{{1,8}}' (one to eight letters)"
    )
    assert widgets.names() == ()


def test_registry_accepts_the_same_function_again_and_refuses_another() -> None:
    widgets = fresh_registry()
    widgets.register("w", one)
    widgets.register("w", one)
    with pytest.raises(InvalidArgumentError) as info:
        widgets.register("w", two)
    assert str(info.value) == f"widget name 'w' is already registered to {__name__}.one"
    assert widgets.get("w") is one


def test_registry_compares_and_names_the_origin_of_wrapped_values() -> None:
    wrapped: Registry[tuple[Any, int]] = Registry(
        "wrapper", re.compile(r"[a-z]+"), origin=lambda value: value[0]
    )
    wrapped.register("w", (one, 1))
    wrapped.register("w", (one, 2))  # same function, new settings: replaces
    assert wrapped.get("w") == (one, 2)
    with pytest.raises(InvalidArgumentError, match=f"registered to {__name__}.one$"):
        wrapped.register("w", (two, 2))


@pytest.mark.parametrize("name", ["nope", "", None, ["w"]])
def test_registry_unknown_names_list_the_known_ones(name: Any) -> None:
    widgets = fresh_registry()
    widgets.register("b", two)
    widgets.register("a", one)
    with pytest.raises(InvalidArgumentError) as info:
        widgets.get(name)
    assert str(info.value) == f"unknown widget {name!r}; expected one of b, a"

    def not_found(value: object, known: tuple[str, ...]) -> NotFoundError:
        return NotFoundError(f"no {value!r} among {known}")

    with pytest.raises(NotFoundError) as custom:
        widgets.get(name, not_found)
    assert str(custom.value) == f"no {name!r} among ('b', 'a')"


def test_registry_scratch_restores_the_registrations_before_it() -> None:
    widgets = fresh_registry()
    widgets.register("kept", one)
    with widgets.scratch() as inside:
        assert inside is widgets
        widgets.register("temp", two)
        assert widgets.names() == ("kept", "temp")
    assert widgets.names() == ("kept",)
    with pytest.raises(InvalidArgumentError, match="unknown widget 'temp'"):
        widgets.get("temp")
    with pytest.raises(RuntimeError), widgets.scratch():
        widgets.register("lost", two)
        raise RuntimeError("restored on errors too")
    assert widgets.names() == ("kept",)


def test_model_registry_keeps_its_own_error_type_and_sorted_names() -> None:
    known = ", ".join(model_registry.known_models())
    for name in ("nope", ["gpt"]):
        with pytest.raises(UnknownModelError) as info:
            model_registry.layer_specs(name, {})  # type: ignore[arg-type]
        assert str(info.value) == f"unknown model {name!r}; known models: {known}"


def test_builtin_names_and_lookups() -> None:
    assert schedule.schedule_names() == ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
    assert schedule.get_schedule("gpipe").actions is schedule.gpipe
    assert schedule.get_schedule("1f1b").actions is schedule.one_f_one_b
    assert schedule.get_schedule("zb-h1").actions is schedule.zb_h1
    assert schedule.get_schedule("interleaved-1f1b").actions is schedule.interleaved_1f1b
    assert partition.partition_names() == ("uniform", "parameters", "memory", "throughput")
    assert partition.get_partition("parameters") is partition.balanced


@pytest.mark.parametrize("name", ["zb", "", "GPIPE", None, ["gpipe"]])
def test_unknown_schedule_names_the_value_and_the_known_names(name: Any) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        schedule.get_schedule(name)
    known = "gpipe, 1f1b, zb-h1, interleaved-1f1b"
    assert f"unknown schedule {name!r}; expected one of {known}" == str(info.value)
    with pytest.raises(InvalidArgumentError, match=f"expected one of {known}"):
        JobConfig(model="mlp", schedule=name)


@pytest.mark.parametrize("name", ["bytes", "", None])
def test_unknown_partition_names_the_value_and_the_known_names(name: Any) -> None:
    known = "uniform, parameters, memory, throughput"
    expected = f"unknown partition method {name!r}; expected one of {known}"
    with pytest.raises(InvalidArgumentError) as info:
        partition.get_partition(name)
    assert str(info.value) == expected
    with pytest.raises(InvalidArgumentError, match="expected one of uniform, parameters"):
        JobConfig(model="mlp", partition=name)


@pytest.mark.usefixtures("scratch_registries")
def test_bad_registrations_are_refused() -> None:
    for bad in ("", "Zb", "a/b", "x" * 65):
        with pytest.raises(InvalidArgumentError, match="must match"):
            schedule.register_schedule(bad)
        with pytest.raises(InvalidArgumentError, match="must match"):
            partition.register_partition(bad)
    with pytest.raises(InvalidArgumentError, match="'gpipe' is already registered"):
        schedule.register_schedule("gpipe")(lifo_gpipe)
    with pytest.raises(InvalidArgumentError, match="'uniform' is already registered"):
        partition.register_partition("uniform")(partition.balanced)
    schedule.register_schedule("gpipe")(schedule.gpipe)  # the same function again is fine
    assert schedule.schedule_names() == ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")


@pytest.mark.usefixtures("scratch_registries")
def test_a_registered_schedule_is_valid_everywhere_and_simulated() -> None:
    schedule.register_schedule("lifo-gpipe")(lifo_gpipe)
    schedule.register_schedule("cyclic")(cyclic)
    assert schedule.schedule_names() == (
        "gpipe",
        "1f1b",
        "zb-h1",
        "interleaved-1f1b",
        "lifo-gpipe",
        "cyclic",
    )
    assert JobConfig(model="mlp", schedule="lifo-gpipe").schedule == "lifo-gpipe"
    assert JobConfig(model="mlp", schedule="cyclic").schedule == "cyclic"
    demo = build_parser().parse_args(["demo", "--schedule", "lifo-gpipe"])
    assert demo.schedule == "lifo-gpipe"
    check_schedule("lifo-gpipe", 3, 4)
    grid = schedule_sim.validate(
        schedule.all_stage_actions("lifo-gpipe", num_stages=3, num_microbatches=4), 4
    )
    assert [a for a in grid[0] if a is not None][-1] == Action.parse("B0")
    # Measured on the action list when the schedule gives no closed form.
    assert schedule.max_in_flight("lifo-gpipe", rank=1, num_stages=3, num_microbatches=4) == 4
    with pytest.raises(InvalidArgumentError, match="schedule deadlocks"):
        check_schedule("cyclic", 2, 2)


@pytest.mark.usefixtures("scratch_registries")
def test_a_schedule_returning_no_actions_list_is_an_internal_error() -> None:
    @schedule.register_schedule("broken")
    def broken(*, rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
        return ["F0"]  # type: ignore[list-item]

    with pytest.raises(InternalError, match="'broken' must return a list of Action"):
        schedule.stage_actions("broken", rank=0, num_stages=1, num_microbatches=1)


@pytest.mark.usefixtures("scratch_registries")
def test_a_registered_partition_is_valid_in_the_config_and_used() -> None:
    @partition.register_partition("last-heavy")
    def last_heavy(costs: Any, num_stages: int) -> list[tuple[int, int]]:
        first = list(range(num_stages - 1))
        return [(i, i + 1) for i in first] + [(num_stages - 1, len(costs))]

    assert "last-heavy" in partition.partition_names()
    assert JobConfig(model="mlp", partition="last-heavy").partition == "last-heavy"
    assert partition.partition("last-heavy", [1] * 6, 3) == [(0, 1), (1, 2), (2, 6)]


def test_cli_schedule_choices_come_from_the_registry() -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--schedule", "zb"])
    for name in schedule.schedule_names():
        assert parser.parse_args(["demo", "--schedule", name]).schedule == name


@pytest.mark.parametrize("name", schedule.schedule_names())
def test_every_registered_schedule_validates_on_a_grid(name: str) -> None:
    """Every schedule is complete and deadlock-free for p in 1..6 and m in 1..10, and its
    closed form of micro-batches in flight (if any) is what its lists keep."""
    for num_stages in range(1, 7):
        for num_microbatches in range(1, 11):
            actions = schedule.all_stage_actions(
                name, num_stages=num_stages, num_microbatches=num_microbatches
            )
            schedule_sim.validate(actions, num_microbatches)
            for rank, rank_actions in enumerate(actions):
                assert schedule.max_in_flight(
                    name, rank=rank, num_stages=num_stages, num_microbatches=num_microbatches
                ) == schedule.max_in_flight_of(rank_actions)


def test_the_readme_names_every_registered_schedule_and_partition() -> None:
    text = README.read_text(encoding="utf-8")
    names = (*schedule.schedule_names(), *partition.partition_names())
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"README.md does not name {missing} (in backquotes)"


def test_plan_entry_conversions_round_trip() -> None:
    stage = PipelineStage(start_layer=2, end_layer=5, rank=1, address="127.0.0.1:7001", replica=3)
    message = stage.to_proto()
    assert (
        message.start_layer,
        message.end_layer,
        message.rank,
        message.address,
        message.replica,
    ) == (2, 5, 1, "127.0.0.1:7001", 3)
    assert PipelineStage.from_proto(message) == stage
    assert stage.to_dict() == {
        "start_layer": 2,
        "end_layer": 5,
        "rank": 1,
        "address": "127.0.0.1:7001",
        "replica": 3,
        "chunk": 0,
    }
    assert PipelineStage.from_dict(stage.to_dict()) == stage
    plan = [PipelineStage(start_layer=0, end_layer=2, rank=0), stage]
    assert plan_from_dicts(plan_to_dicts(plan)) == plan


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"start_layer": 0, "end_layer": 1, "rank": 0, "host": "x"}, "unknown fields ['host']"),
        ({"start_layer": 0, "end_layer": 1}, "'rank'"),
        ({"start_layer": "0", "end_layer": 1, "rank": 0}, "start_layer ('0')"),
        ({"start_layer": 0, "end_layer": 1, "rank": True}, "rank (True)"),
        ({"start_layer": 0, "end_layer": 1, "rank": 0, "address": 7}, "address (7)"),
        ([0, 1, 0], "must be a mapping"),
    ],
)
def test_plan_entry_from_dict_rejects(values: Any, named: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        PipelineStage.from_dict(values)
    assert named in str(info.value)
