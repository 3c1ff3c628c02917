"""The command line's defaults are the defaults of the options they fill: they cannot drift."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from pipesvc.cli import build_parser
from pipesvc.coordinator.options import CoordinatorOptions
from pipesvc.coordinator.stage_calls import Deadlines
from pipesvc.core.limits import Limits
from pipesvc.demo import DemoOptions
from pipesvc.stage.options import StageOptions
from pipesvc.stage.server import run_stage

COMMANDS = {
    "coordinator": [],
    "stage": ["--coordinator", "127.0.0.1:1"],
    "demo": [],
}


def field_default(cls: type, name: str) -> Any:
    (found,) = [f for f in dataclasses.fields(cls) if f.name == name]
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    assert found.default is not dataclasses.MISSING, f"{cls.__name__}.{name} has no default"
    return found.default


def parsed(command: str) -> dict[str, Any]:
    return vars(build_parser().parse_args([command, *COMMANDS[command]]))


@pytest.mark.parametrize(
    ("flag", "cls", "name"),
    [
        ("--step-timeout-s", Deadlines, "step_s"),
        ("--control-timeout-s", Deadlines, "control_s"),
        ("--health-interval-s", Deadlines, "health_interval_s"),
        ("--health-failures", Deadlines, "health_failures"),
        ("--state-dir", CoordinatorOptions, "state_dir"),
        ("--listen", CoordinatorOptions, "listen"),
        ("--forget-stages-after-s", CoordinatorOptions, "forget_stages_after_s"),
        ("--store-port", CoordinatorOptions, "store_port"),
    ],
)
def test_coordinator_flags_default_to_the_options_they_fill(
    flag: str, cls: type, name: str
) -> None:
    assert parsed("coordinator")[name] == field_default(cls, name)
    value = "7" if isinstance(field_default(cls, name), int | float) else "x:1"
    assert str(vars(build_parser().parse_args(["coordinator", flag, value]))[name]) in (
        value,
        f"{value}.0",
    )


def test_stage_flags_default_to_the_stage_options_and_run_stage() -> None:
    args = parsed("stage")
    assert args["recv_timeout_s"] == field_default(StageOptions, "recv_timeout_s")
    assert args["shm_bytes"] == field_default(StageOptions, "shm_bytes")
    assert args["kv_budget_bytes"] == field_default(StageOptions, "kv_budget_bytes")
    assert args["session_idle_s"] == field_default(StageOptions, "session_idle_s")
    signature = inspect.signature(run_stage).parameters
    for name in ("heartbeat_interval_s", "drain_timeout_s"):
        assert args[name] == signature[name].default, name


@pytest.mark.parametrize("command", ["coordinator", "stage"])
def test_limit_flags_default_to_the_limits(command: str) -> None:
    args = parsed(command)
    assert Limits(**{name: args[name] for name in Limits.__dataclass_fields__}) == Limits()


def test_demo_flags_default_to_the_demo_options() -> None:
    args = parsed("demo")
    assert args["stages"] == field_default(DemoOptions, "num_stages")
    assert args["minutes"] * 60 == field_default(DemoOptions, "duration_s")
    assert args["max_steps"] == field_default(DemoOptions, "max_steps")
    assert args["schedule"] == field_default(DemoOptions, "schedule")


def test_limit_and_stage_help_repeat_the_field_docs() -> None:
    stage = next(
        action.choices["stage"]
        for action in build_parser()._actions
        if isinstance(action.choices, dict)
    )
    text = " ".join(stage.format_help().split())
    assert "largest gRPC message, in either direction" in text
    assert "longest wait for one activation or gradient before the run fails (default 300.0)" in (
        text
    )
    assert "(default 256MiB)" in text
