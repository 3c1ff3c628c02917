"""The test-only ``--fault-kill`` flag: where a stage fails itself, and how."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipesvc.errors import InvalidArgumentError, ResourceExhaustedError
from pipesvc.stage.compute.faults import FaultKill


@pytest.mark.parametrize(
    ("text", "when", "action"),
    [
        ("commit:3:1:/tmp/m", "commit", "kill"),
        ("commit-stop:3:1:/tmp/m", "commit", "stop"),
        ("forward-fail:3:1:/tmp/m", "forward", "fail"),
        ("backward-kill:3:1:/tmp/m", "backward", "kill"),
    ],
)
def test_parse(text: str, when: str, action: str) -> None:
    fault = FaultKill.parse(text)
    assert (fault.when, fault.step, fault.rank, fault.marker, fault.action) == (
        when,
        3,
        1,
        "/tmp/m",
        action,
    )


@pytest.mark.parametrize("text", ["commit-hang:3:1:m", "load:3:1:m", "commit:x:1:m", "commit:3:1:"])
def test_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="--fault-kill"):
        FaultKill.parse(text)


def test_fail_fires_once_per_marker(tmp_path: Path) -> None:
    fault = FaultKill.parse(f"commit-fail:3:1:{tmp_path / 'm'}")
    fault.check(when="commit", step=2, rank=1, microbatch=0, last_mb=0)  # another step
    fault.check(when="commit", step=3, rank=0, microbatch=0, last_mb=0)  # another rank
    with pytest.raises(ResourceExhaustedError, match="commit of step 3 refused"):
        fault.check(when="commit", step=3, rank=1, microbatch=0, last_mb=0)
    fault.check(when="commit", step=3, rank=1, microbatch=0, last_mb=0)  # fired already
