"""The HTTP API's first step watches its client (``openai_api._first_step``): a client gone
before the first token has its session left, and the step's own errors come out as they are
(not wrapped in the watcher's task group's ``ExceptionGroup``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import pytest

from pipesvc.coordinator.serve_http import openai_api
from pipesvc.errors import KVBudgetError


class _Client:
    """A request whose client goes away after ``checks`` checks (never if None)."""

    def __init__(self, checks: int | None) -> None:
        self.checks = checks
        self.asked = 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return self.checks is not None and self.asked > self.checks


def _first_step(client: _Client, start: Callable[[list[Callable[[], None]]], object]) -> object:
    async def run() -> object:
        return await openai_api._first_step(client, start)  # type: ignore[arg-type]

    return anyio.run(run)


def test_a_client_gone_before_the_first_token_leaves_its_session() -> None:
    left = threading.Event()

    def start(on_open: list[Callable[[], None]]) -> object:
        on_open.append(left.set)
        assert left.wait(10), "the session was never left"
        return ("completion", "")  # as a session left before its first token ends

    assert _first_step(_Client(checks=2), start) == ("completion", "")
    assert left.is_set()


def test_a_client_that_stays_is_not_left_and_the_step_s_errors_come_out_whole() -> None:
    left = threading.Event()

    def start(on_open: list[Callable[[], None]]) -> object:
        on_open.append(left.set)
        return ("completion", "first")

    client = _Client(checks=None)
    assert _first_step(client, start) == ("completion", "first")
    assert not left.is_set()

    def refused(on_open: list[Callable[[], None]]) -> object:
        raise KVBudgetError("over the budget")

    with pytest.raises(KVBudgetError, match="over the budget"):
        _first_step(_Client(checks=None), refused)
