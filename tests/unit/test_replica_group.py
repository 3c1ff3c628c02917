"""The gradient sum over replicas (see [Note: gradient group]): real gloo groups formed on the
coordinator's store, their members on threads of this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest
import torch
from torch import distributed

from pipesvc.coordinator.replicas import Rendezvous
from pipesvc.errors import StageUnavailableError, StepAbortedError
from pipesvc.stage.collective import replica_group
from pipesvc.stage.collective.replica_group import GroupSpec, ReplicaGroup
from tests.support.faults import free_port


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    rendezvous = Rendezvous(bind="127.0.0.1")
    yield int(rendezvous.spec("any", 0, 0).store_port)
    rendezvous.close()


def _member(replica: int, replicas: int, job: str, timeout_s: float = 20.0) -> ReplicaGroup:
    return ReplicaGroup(
        job_id=job,
        epoch=1,
        rank=0,
        replica=replica,
        num_replicas=replicas,
        own_host="127.0.0.1",
        coordinator_host="127.0.0.1",
        timeout_s=timeout_s,
    )


def _params(replica: int) -> list[torch.nn.Parameter]:
    """Three parameters: one every replica used, one only replica 0 used, one none used."""
    used = torch.nn.Parameter(torch.zeros(3, 2))
    used.grad = torch.full((3, 2), float(replica + 1))
    some = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    if replica == 0:
        some.grad = torch.ones(4, dtype=torch.bfloat16)
    unused = torch.nn.Parameter(torch.zeros(2))
    return [used, some, unused]


def _together(count: int, work: Callable[[int], object]) -> list[object]:
    with futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(work, range(count)))


def test_three_replicas_sum_their_gradients(store_port: int) -> None:
    members = [_member(r, 3, "sum") for r in range(3)]
    spec = GroupSpec(store_host="", store_port=store_port, generation=0)
    for run_id in (1, 2):  # the second run reuses the group; gradients start over
        params = [_params(r) for r in range(3)]
        _together(3, lambda r, run=run_id, ps=params: members[r].reduce(run, spec, ps[r]))
        for used, some, unused in params:
            torch.testing.assert_close(used.grad, torch.full((3, 2), 6.0))
            assert some.grad is not None and some.grad.dtype == torch.bfloat16
            torch.testing.assert_close(some.grad, torch.ones(4, dtype=torch.bfloat16))
            assert unused.grad is None, "no replica used it: no gradient, as in one process"
    assert [m.formed for m in members] == [1, 1, 1]
    # Each meeting's keys are deleted once every member has passed the next one.
    meetings = distributed.PrefixStore(
        "pipesvc/sum/1/0/rank0/meet",
        distributed.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False),
    )
    assert not meetings.check(["1"]) and not meetings.check(["1/all"])
    assert meetings.check(["2/all"])
    newer = GroupSpec(store_host="", store_port=store_port, generation=1)
    _together(3, lambda r: members[r].reduce(3, newer, _params(r)))
    assert [m.formed for m in members] == [2, 2, 2]
    for m in members:
        m.close()


def test_an_abort_wakes_a_sum_whose_peer_never_comes(store_port: int) -> None:
    members = [_member(r, 2, "abort") for r in range(2)]
    spec = GroupSpec(store_host="", store_port=store_port, generation=0)
    _together(2, lambda r: members[r].reduce(1, spec, _params(r)))  # formed
    threading.Timer(0.3, members[0].abort, args=(2,)).start()
    started = time.monotonic()
    params = _params(0)
    with pytest.raises(StepAbortedError, match="run 2 was aborted"):
        members[0].reduce(2, spec, params)
    assert time.monotonic() - started < 5
    torch.testing.assert_close(params[0].grad, torch.ones(3, 2))  # no gradient changed
    for m in members:
        m.close()


def test_an_abort_wakes_a_group_still_forming(store_port: int) -> None:
    lonely = _member(0, 2, "forming")
    threading.Timer(0.3, lonely.abort, args=(1,)).start()
    started = time.monotonic()
    with pytest.raises(StepAbortedError, match="formed"):
        lonely.reduce(1, GroupSpec("", store_port, 0), _params(0))
    assert time.monotonic() - started < 5


def test_a_member_that_never_joins_fails_the_sum_with_the_reason(store_port: int) -> None:
    lonely = _member(0, 2, "no-show", timeout_s=1.0)
    with pytest.raises(StageUnavailableError, match=r"gradient group of rank 0 .* did not form"):
        lonely.reduce(1, GroupSpec("", store_port, 0), _params(0))


def test_a_store_nobody_serves_is_named() -> None:
    member = _member(0, 2, "nowhere", timeout_s=1.0)
    member._coordinator_host = ""
    with pytest.raises(Exception, match="no store"):
        member.reduce(1, GroupSpec("", 0, 0), _params(0))


def test_a_restarted_store_on_the_same_port_reforms_the_group() -> None:
    # A fixed store port: the restarted coordinator's store has the old one's address, and
    # generations count from 0 again; the stages must still form their groups anew on it.
    port = free_port()
    members = [_member(r, 2, "restart") for r in range(2)]
    first = Rendezvous(bind="127.0.0.1", port=port)
    spec = GroupSpec.from_proto(first.spec("restart", 1, 0))
    _together(2, lambda r: members[r].reduce(1, spec, _params(r)))
    first.close()  # the coordinator is gone, and its store with it
    with pytest.raises(StageUnavailableError, match=rf"could not meet at its store .*:{port}"):
        members[0].reduce(2, spec, _params(0))  # typed, and the stale group is dropped
    second = Rendezvous(bind="127.0.0.1", port=port)
    again = GroupSpec.from_proto(second.spec("restart", 1, 0))
    assert (again.store_port, again.generation) == (spec.store_port, spec.generation)
    params = [_params(r) for r in range(2)]
    _together(2, lambda r: members[r].reduce(1, again, params[r]))
    for used, _, _ in params:
        torch.testing.assert_close(used.grad, torch.full((3, 2), 3.0))
    assert [m.formed for m in members] == [2, 2]
    for m in members:
        m.close()
    second.close()


def test_the_store_keeps_only_the_current_generation_of_each_job() -> None:
    # Every abort starts a new generation, whose groups form anew; the keys of past ones
    # (gloo's rendezvous, the last meeting) are deleted, and a closed job's all.
    rendezvous = Rendezvous(bind="127.0.0.1")
    members = [_member(r, 2, "keys") for r in range(2)]
    counts = []
    for generation in range(6):
        spec = GroupSpec.from_proto(rendezvous.spec("keys", 1, generation))
        for run_id in (2 * generation + 1, 2 * generation + 2):
            _together(2, lambda r, s=spec, i=run_id: members[r].reduce(i, s, _params(r)))
        counts.append(rendezvous.num_keys())
    assert [m.formed for m in members] == [6, 6]
    assert counts[0] > 0 and counts == [counts[0]] * 6, counts
    rendezvous.forget("keys")
    assert rendezvous.num_keys() == 0
    for m in members:
        m.close()
    rendezvous.close()


def test_a_sum_a_member_hangs_in_is_parked_until_gloo_ends_it(
    store_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_group, "PARK_MARGIN_S", 3.0)  # counted well within it
    before = replica_group.parked()
    waiting, hanging = _member(0, 2, "hang", timeout_s=1.0), _member(1, 2, "hang", timeout_s=1.0)
    spec = GroupSpec("", store_port, 0)

    def hang() -> None:  # meets the other member, then never posts its side of the sum
        never = threading.Event()
        hanging._group_for(spec, never)
        hanging._meet(1, never)

    members = (waiting, hanging)
    _together(2, lambda r: members[r].reduce(0, spec, _params(r)))  # formed
    thread = threading.Thread(target=hang)
    thread.start()
    with pytest.raises(StageUnavailableError, match="did not finish"):
        waiting.reduce(1, spec, _params(0))
    thread.join()
    assert replica_group.parked() == before + 2  # the flags and the one bucket
    deadline = time.monotonic() + 30
    while replica_group.parked() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert replica_group.parked() == before, "released once gloo ended them"
    hanging.close()
