"""Who owns a process that LocalCluster started, and what a child does with it (see [Note: owned
processes] in ``pipesvc.owner``); the deaths themselves are in
``tests/integration/test_local_cluster_orphans.py``."""

from __future__ import annotations

import os
import threading

import pytest

from pipesvc.owner import OWNER_DEATHSIG_ENV, OWNER_PID_ENV, follow_owner, owner_environ


def test_the_owner_names_itself_and_asks_for_the_death_signal_on_its_main_thread() -> None:
    env = owner_environ({"KEEP": "1"})
    assert env == {"KEEP": "1", OWNER_PID_ENV: str(os.getpid()), OWNER_DEATHSIG_ENV: "1"}


def test_an_owner_on_another_thread_does_not_ask_for_the_death_signal() -> None:
    # The kernel sends PDEATHSIG when the forking thread ends, not the process.
    envs: list[dict[str, str]] = []
    worker = threading.Thread(target=lambda: envs.append(owner_environ({})))
    worker.start()
    worker.join()
    assert envs[0][OWNER_DEATHSIG_ENV] == "0"
    assert envs[0][OWNER_PID_ENV] == str(os.getpid())


def test_a_process_nobody_owns_is_left_alone() -> None:
    env = {"KEEP": "1"}
    assert follow_owner(env)
    assert env == {"KEEP": "1"}


def test_a_child_whose_owner_is_already_gone_is_told_to_stop() -> None:
    # The owner died before the child could set the flag: the child has another parent.
    env = {OWNER_PID_ENV: str(os.getppid() + 1_000_000), OWNER_DEATHSIG_ENV: "0", "KEEP": "1"}
    assert not follow_owner(env)
    assert env == {"KEEP": "1"}, "the owner's variables are not passed on"


def test_an_owner_that_is_not_a_pid_is_named() -> None:
    with pytest.raises(ValueError, match=f"{OWNER_PID_ENV}='abc' is not a process id"):
        follow_owner({OWNER_PID_ENV: "abc"})
