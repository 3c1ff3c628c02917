"""The coordinator forgets stages it has not seen for a while (see [Note: forgetting stages]):
in memory and in its state database, except stages a job uses; one that comes back registers
anew. Real service objects on a real SQLite file; no stage processes (no call reaches one)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipesvc.coordinator.service import CoordinatorService
from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import coordinator_pb2
from pipesvc.wire.protocol import WIRE_PROTOCOL

AFTER_S = 0.3


def _register(service: CoordinatorService, port: int) -> None:
    request = coordinator_pb2.RegisterStageRequest(
        address=f"127.0.0.1:{port}",
        device="cpu",
        memory_bytes=1 << 30,
        models=["mlp"],
        protocol=WIRE_PROTOCOL,
    )
    service.RegisterStage(request, None)


def _known(service: CoordinatorService) -> list[str]:
    return sorted(r.address for r in service.registry.all())


def test_stages_unseen_for_the_limit_are_forgotten_unless_a_job_uses_them(
    tmp_path: Path,
) -> None:
    service = CoordinatorService(tmp_path, forget_stages_after_s=AFTER_S)
    service.open()
    for port in (1001, 1002, 1003):
        _register(service, port)
    assert service.registry.claim(["127.0.0.1:1003"], "a-job")
    time.sleep(AFTER_S * 2)
    _register(service, 1002)  # its heartbeat: seen again
    assert service.forget_unseen_stages() == ["127.0.0.1:1001"]
    assert _known(service) == ["127.0.0.1:1002", "127.0.0.1:1003"]
    service.shutdown()

    # The database forgot it too: a restarted coordinator does not bring it back.
    again = CoordinatorService(tmp_path, forget_stages_after_s=AFTER_S)
    again.open()
    assert _known(again) == ["127.0.0.1:1002", "127.0.0.1:1003"]
    # Read back from the database, they count as seen at the restart, and are forgotten if
    # they do not come back in time; one that comes back later registers anew.
    time.sleep(AFTER_S * 2)
    assert again.forget_unseen_stages() == ["127.0.0.1:1002", "127.0.0.1:1003"]
    _register(again, 1003)
    assert [(r.address, r.alive, r.job_id) for r in again.registry.all()] == [
        ("127.0.0.1:1003", True, "")
    ]
    again.shutdown()
    final = CoordinatorService(tmp_path)
    final.open()
    assert _known(final) == ["127.0.0.1:1003"]
    final.shutdown()


@pytest.mark.parametrize("after_s", [0.0, -1.0, float("nan")])
def test_a_limit_that_is_not_positive_is_refused(tmp_path: Path, after_s: float) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"forget_stages_after_s \({after_s}\)"):
        CoordinatorService(tmp_path, forget_stages_after_s=after_s)
