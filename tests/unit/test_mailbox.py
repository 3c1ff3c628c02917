"""Unit tests for pipesvc.stage.dataplane.mailbox: exactly-once delivery, staleness, abort,
timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from pipesvc.core.limits import MAX_MICROBATCHES
from pipesvc.errors import (
    PipelineTimeoutError,
    ResourceExhaustedError,
    StageUnavailableError,
    StepAbortedError,
)
from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, NORM_PART, Mailbox, MailKey

SHORT_S = 0.05


def key(run_id: int = 1, direction: str = ACTIVATION, microbatch_index: int = 0) -> MailKey:
    return MailKey(run_id=run_id, direction=direction, microbatch_index=microbatch_index)


class Waiter:
    """Runs ``mailbox.get`` in a thread and records what it returned or raised, and when."""

    def __init__(self, get: Callable[[], torch.Tensor]) -> None:
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.finished_at = 0.0
        self._thread = threading.Thread(target=self._run, args=(get,), daemon=True)
        self._thread.start()
        time.sleep(SHORT_S)  # let it reach the wait
        assert self._thread.is_alive(), "the waiter returned before it was woken"

    def _run(self, get: Callable[[], torch.Tensor]) -> None:
        try:
            self.result = get()
        except BaseException as exc:
            self.error = exc
        self.finished_at = time.monotonic()

    def join(self, timeout_s: float = 5.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the waiter was not woken"


def test_put_then_get_returns_the_tensor_and_removes_it() -> None:
    mailbox = Mailbox()
    tensor = torch.arange(3.0)
    assert mailbox.put(key(), tensor)
    assert len(mailbox) == 1
    assert mailbox.get(key(), timeout_s=1.0) is tensor
    assert len(mailbox) == 0


def test_keys_are_distinguished_by_every_field() -> None:
    mailbox = Mailbox()
    keys = [key(), key(run_id=2), key(direction=GRADIENT), key(microbatch_index=1)]
    for index, k in enumerate(keys):
        assert mailbox.put(k, torch.tensor(index))
    for index, k in reversed(list(enumerate(keys))):
        assert mailbox.get(k, timeout_s=1.0).item() == index


def test_get_waits_for_a_later_put() -> None:
    mailbox = Mailbox()
    waiter = Waiter(lambda: mailbox.get(key(), timeout_s=5.0))
    tensor = torch.ones(2)
    assert mailbox.put(key(), tensor)
    waiter.join()
    assert waiter.error is None
    assert waiter.result is tensor


def test_duplicate_put_is_dropped_and_delivered_once() -> None:
    mailbox = Mailbox()
    first, second = torch.tensor(1.0), torch.tensor(2.0)
    assert mailbox.put(key(), first)
    assert not mailbox.put(key(), second)
    assert mailbox.num_duplicates == 1
    assert mailbox.get(key(), timeout_s=1.0) is first
    assert len(mailbox) == 0


def test_duplicate_after_consumption_is_dropped() -> None:
    mailbox = Mailbox()
    assert mailbox.put(key(), torch.tensor(1.0))
    mailbox.get(key(), timeout_s=1.0)
    assert not mailbox.put(key(), torch.tensor(2.0))
    assert mailbox.num_duplicates == 1
    with pytest.raises(PipelineTimeoutError):
        mailbox.get(key(), timeout_s=SHORT_S)


def test_mail_of_a_finished_run_is_stale() -> None:
    mailbox = Mailbox()
    assert mailbox.put(key(run_id=2), torch.tensor(0.0))
    mailbox.finish(2)
    assert len(mailbox) == 0  # unconsumed mail of the finished run is dropped
    assert not mailbox.put(key(run_id=2, microbatch_index=1), torch.tensor(1.0))
    assert not mailbox.put(key(run_id=1), torch.tensor(1.0))
    assert mailbox.num_stale == 2
    assert mailbox.put(key(run_id=3), torch.tensor(1.0))


def test_finish_never_moves_backwards() -> None:
    mailbox = Mailbox()
    mailbox.finish(5)
    mailbox.finish(2)
    assert not mailbox.put(key(run_id=4), torch.tensor(0.0))


def test_early_mail_for_a_later_run_survives_finish() -> None:
    mailbox = Mailbox()
    early = torch.tensor(7.0)
    assert mailbox.put(key(run_id=3), early)
    assert mailbox.put(key(run_id=2), torch.tensor(0.0))
    mailbox.finish(2)
    assert len(mailbox) == 1
    assert mailbox.get(key(run_id=3), timeout_s=1.0) is early


def test_abort_wakes_a_waiting_get_promptly() -> None:
    mailbox = Mailbox()
    waiter = Waiter(lambda: mailbox.get(key(run_id=4), timeout_s=30.0))
    aborted_at = time.monotonic()
    mailbox.abort(4)
    waiter.join()
    assert isinstance(waiter.error, StepAbortedError)
    assert "4" in str(waiter.error)
    assert waiter.finished_at - aborted_at < 1.0


def test_abort_drops_the_runs_mail_and_later_mail_is_stale() -> None:
    mailbox = Mailbox()
    assert mailbox.put(key(run_id=4), torch.tensor(0.0))
    assert mailbox.put(key(run_id=5), torch.tensor(5.0))
    mailbox.abort(4)
    assert len(mailbox) == 1
    assert not mailbox.put(key(run_id=4, microbatch_index=1), torch.tensor(1.0))
    with pytest.raises(StepAbortedError):
        mailbox.get(key(run_id=4), timeout_s=1.0)
    assert mailbox.get(key(run_id=5), timeout_s=1.0).item() == 5.0


def test_abort_of_another_run_does_not_wake_a_waiter() -> None:
    mailbox = Mailbox()
    waiter = Waiter(lambda: mailbox.get(key(run_id=2), timeout_s=5.0))
    mailbox.abort(1)
    time.sleep(SHORT_S)
    assert waiter.error is None and waiter.result is None
    assert mailbox.put(key(run_id=2), torch.tensor(2.0))
    waiter.join()
    assert waiter.error is None and waiter.result is not None


def test_get_times_out_naming_the_key() -> None:
    mailbox = Mailbox()
    assert mailbox.put(key(microbatch_index=2), torch.tensor(0.0))
    started = time.monotonic()
    with pytest.raises(PipelineTimeoutError) as info:
        mailbox.get(
            key(run_id=6, direction=GRADIENT, microbatch_index=3),
            timeout_s=0.1,
            waiting_for=" from stage 2",
        )
    elapsed = time.monotonic() - started
    assert 0.1 <= elapsed < 2.0
    message = str(info.value)
    assert "gradient of micro-batch 3 (run 6)" in message
    assert "from stage 2" in message


def test_fail_makes_waiters_raise_that_error() -> None:
    mailbox = Mailbox()
    error = StageUnavailableError("link to stage 1 broke")
    waiter = Waiter(lambda: mailbox.get(key(), timeout_s=30.0))
    mailbox.fail(error)
    waiter.join()
    assert waiter.error is error
    with pytest.raises(StageUnavailableError):
        mailbox.get(key(microbatch_index=1), timeout_s=1.0)


def test_mail_that_arrived_is_still_delivered_after_fail() -> None:
    mailbox = Mailbox()
    tensor = torch.tensor(1.0)
    assert mailbox.put(key(), tensor)
    mailbox.fail(StageUnavailableError("broken"))
    assert mailbox.get(key(), timeout_s=1.0) is tensor


def test_reset_failure_lets_gets_wait_again() -> None:
    mailbox = Mailbox()
    mailbox.fail(StageUnavailableError("broken"))
    mailbox.reset_failure()
    with pytest.raises(PipelineTimeoutError):
        mailbox.get(key(), timeout_s=SHORT_S)


def test_max_items_is_enforced() -> None:
    mailbox = Mailbox(max_items=2)
    assert mailbox.put(key(microbatch_index=0), torch.tensor(0.0))
    assert mailbox.put(key(microbatch_index=1), torch.tensor(1.0))
    with pytest.raises(ResourceExhaustedError, match="limit is 2"):
        mailbox.put(key(microbatch_index=2), torch.tensor(2.0))
    assert len(mailbox) == 2
    mailbox.get(key(microbatch_index=0), timeout_s=1.0)
    assert mailbox.put(key(microbatch_index=2), torch.tensor(2.0))


def test_default_mailbox_holds_the_largest_run_and_the_next_runs_early_activations() -> None:
    # A stage of a run with the most micro-batches a job may ask for can hold every activation
    # and gradient of it before taking any, plus the next run's activations arriving early,
    # plus the norm mail of a job that clips (this run's sum, the next run's total).
    mailbox = Mailbox()
    for index in range(MAX_MICROBATCHES):
        for direction in (ACTIVATION, GRADIENT):
            assert mailbox.put(key(1, direction, index), torch.tensor(0.0))
        assert mailbox.put(key(2, ACTIVATION, index), torch.tensor(0.0))
    assert mailbox.put(MailKey(1, GRADIENT, 0, NORM_PART), torch.zeros(1, dtype=torch.float64))
    assert mailbox.put(MailKey(2, ACTIVATION, 0, NORM_PART), torch.zeros(1, dtype=torch.float64))
    assert len(mailbox) == 3 * MAX_MICROBATCHES + 2
    with pytest.raises(ResourceExhaustedError, match=f"limit is {3 * MAX_MICROBATCHES + 2}"):
        mailbox.put(key(3, ACTIVATION, 0), torch.tensor(0.0))
