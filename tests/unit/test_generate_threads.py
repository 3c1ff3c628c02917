"""A generation run's torch threads (see [Note: generation threads] in pipesvc.stage.service)."""

from __future__ import annotations

import threading

import pytest
import torch

from pipesvc.local_cluster import COLOCATED_SPIN_COUNT, LocalCluster, colocated_environ
from pipesvc.stage.service import _threads


def test_a_run_sets_its_threads_on_its_own_thread_and_puts_them_back() -> None:
    before = torch.get_num_threads()
    seen: dict[str, int] = {}
    inside = threading.Event()
    leave = threading.Event()

    def run() -> None:
        torch.set_num_threads(1)
        with _threads(3):
            seen["inside"] = torch.get_num_threads()
            inside.set()
            leave.wait(10)
        seen["after"] = torch.get_num_threads()

    worker = threading.Thread(target=run)
    worker.start()
    assert inside.wait(10)
    seen["other thread"] = torch.get_num_threads()  # while the run holds 3
    leave.set()
    worker.join(10)
    assert seen == {"inside": 3, "other thread": before, "after": 1}


def test_zero_keeps_the_threads_as_they_are() -> None:
    before = torch.get_num_threads()
    with _threads(0):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def test_a_local_cluster_gives_generation_every_core_and_training_a_share() -> None:
    cluster = LocalCluster(num_stages=2)
    assert cluster.generate_threads >= cluster.threads_per_stage
    assert LocalCluster(num_stages=2, generate_threads=1).generate_threads == 1


def test_co_located_stages_spin_less_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """See [Note: co-located stages spin less] in pipesvc.local_cluster."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = colocated_environ()
    assert env["GOMP_SPINCOUNT"] == COLOCATED_SPIN_COUNT
    assert "glibc.malloc.tcache_count" in env["GLIBC_TUNABLES"]  # the stage's own settings too
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    assert colocated_environ()["GOMP_SPINCOUNT"] == "7"  # the operator's
