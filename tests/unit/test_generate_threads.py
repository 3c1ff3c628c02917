"""A generation run's torch threads (see [Note: generation threads] in pipesvc.stage.service)."""

from __future__ import annotations

import threading

import pytest
import torch

from pipesvc.core.microbatch import CacheRef
from pipesvc.local_cluster import COLOCATED_SPIN_COUNT, LocalCluster, colocated_environ
from pipesvc.stage.service import _threads, in_turn


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


def _ref(session: str, positions: int, *, fresh: bool = False) -> CacheRef:
    return CacheRef(session, 0, fresh=fresh, rows=1, positions=positions)


def test_runs_whose_stages_compute_in_turn_get_the_generation_threads() -> None:
    prompts = (_ref("a", 16, fresh=True), _ref("b", 12, fresh=True))  # fused, left-padded
    decode = (_ref("c", 1), _ref("d", 1))
    # One micro-batch: a decode step, several steps of one, fused prompts.
    assert in_turn([decode], 1)
    assert in_turn([(_ref("c", 4),)], 1)  # a run of 4 decode steps
    assert in_turn([prompts], 1)
    # New prompts beside the others' decode steps: the prompts dominate, in turn.
    assert in_turn([prompts, decode], 2)
    assert in_turn([(_ref("e", 300),), decode], 2)  # one chunk of a long prompt beside them
    # Several wide micro-batches pipeline: a prompt's chunks, prompts keeping prefixes.
    assert not in_turn([(_ref("e", 256),), (_ref("e", 256),), (_ref("e", 256),)], 3)
    assert not in_turn([(_ref("f", 9, fresh=True),), (_ref("g", 7, fresh=True),), decode], 3)
    # No caches (a model that recomputes): by the micro-batches alone.
    assert in_turn([], 1)
    assert not in_turn([], 2)
