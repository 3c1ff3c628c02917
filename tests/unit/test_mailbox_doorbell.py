"""The thread waiting for mail reads the shared-memory doorbells itself (see [Note: the waiter
reads the doorbell] in pipesvc.stage.dataplane.mailbox): what must still end or wake such a wait."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pipesvc.core.tensor_codec import CodecLimits
from pipesvc.errors import StageUnavailableError, StepAbortedError
from pipesvc.observe.metrics import NO_METRICS
from pipesvc.stage.dataplane import mailbox as mailbox_module
from pipesvc.stage.dataplane.frame_wire import InFrame
from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
from pipesvc.stage.dataplane.microbatch_id import opposite
from pipesvc.stage.dataplane.reader import FrameReader
from pipesvc.stage.dataplane.sender import Sender

_JOIN_S = 30.0
"""A bound for a thread that must end; a hang fails the test instead of the run."""


class _Doorbell:
    """A sender whose tensors reach ``receiver`` through shared memory (no gRPC: the
    handshake's frames are handed over here)."""

    def __init__(
        self,
        receiver: Mailbox,
        direction: str = ACTIVATION,
        while_full: Callable[[], None] = lambda: None,
        handshake_index: int = 0,
    ) -> None:
        self.sender = Sender(
            job_id="j", epoch=1, direction=direction, shm_bytes=4 << 20, while_full=while_full
        )
        self._frames: Iterator[Any] = self.sender.frames()  # kept: dropping it ends the link
        reply = Sender(job_id="j", epoch=1, direction=opposite(direction), shm_bytes=0)
        self.reader = FrameReader(
            job_id="j",
            epoch=1,
            direction=direction,
            mailbox=receiver,
            limits=CodecLimits(),
            metrics=NO_METRICS,
            reply=reply,
        )
        first = MailKey(0, direction, handshake_index)
        self.sender.put((first, torch.zeros(1)))  # the first tensor makes the offer
        self.reader.feed(next(self._frames))  # the offer
        out = next(self._frames)  # the first tensor, as frames
        self.reader.feed(InFrame(out.frame, memoryview(bytes(out.data))))
        self.sender.on_answer(next(reply.frames()).shm_answer)
        assert self.sender.uses_shm and receiver.num_sources == 1
        assert torch.equal(receiver.get(first, _JOIN_S), torch.zeros(1))

    def send(self, key: MailKey, tensor: torch.Tensor) -> None:
        self.sender.put((key, tensor))


class _Waiter:
    """``mailbox.get`` on a thread of its own, once it is polling the doorbells."""

    def __init__(self, mailbox: Mailbox, key: MailKey) -> None:
        self.result: Any = None
        self._thread = threading.Thread(target=self._run, args=(mailbox, key), daemon=True)
        self._thread.start()
        while mailbox._poller is None and self._thread.is_alive():
            self._thread.join(0.01)

    def _run(self, mailbox: Mailbox, key: MailKey) -> None:
        try:
            self.result = mailbox.get(key, 3600.0)
        except Exception as exc:  # handed to the test
            self.result = exc

    def join(self) -> Any:
        self._thread.join(_JOIN_S)
        assert not self._thread.is_alive(), "the wait did not end"
        return self.result


@pytest.fixture
def no_safety_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a wake-up can end a poll: none of these tests passes by the periodic re-check."""
    monkeypatch.setattr(mailbox_module, "_MAX_POLL_S", 3600.0)


def test_the_waiter_reads_the_doorbell_itself(no_safety_poll: None) -> None:
    mailbox = Mailbox()
    bell = _Doorbell(mailbox)
    x = torch.randn(5, 3)
    bell.send(MailKey(1, ACTIVATION, 0), x)
    assert len(mailbox) == 0  # rung, not read: no thread reads the doorbell
    assert not any(t.name == "doorbell" for t in threading.enumerate())
    assert torch.equal(mailbox.get(MailKey(1, ACTIVATION, 0), _JOIN_S), x)
    waiter = _Waiter(mailbox, MailKey(1, ACTIVATION, 1))
    bell.send(MailKey(1, ACTIVATION, 1), x * 2)  # rung during the wait
    assert torch.equal(waiter.join(), x * 2)


def test_an_abort_ends_a_wait_on_the_doorbell(no_safety_poll: None) -> None:
    mailbox = Mailbox()
    _bell = _Doorbell(mailbox)
    waiter = _Waiter(mailbox, MailKey(1, ACTIVATION, 0))
    mailbox.abort(1)
    assert isinstance(waiter.join(), StepAbortedError)


def test_a_failed_link_ends_a_wait_on_the_doorbell(no_safety_poll: None) -> None:
    """A dead neighbour: its stream fails (the doorbell itself only reads end-of-file)."""
    mailbox = Mailbox()
    bell = _Doorbell(mailbox)
    waiter = _Waiter(mailbox, MailKey(1, ACTIVATION, 0))
    bell.sender.close()  # the sender's end of the doorbell closes, as when its process dies
    error = StageUnavailableError("data stream to the neighbour failed")
    mailbox.fail(error)
    assert waiter.join() is error
    assert mailbox.num_sources == 0  # the doorbell at end-of-file was dropped and closed


def test_a_tensor_from_a_stream_ends_a_wait_on_the_doorbell(no_safety_poll: None) -> None:
    """Gradients come on the gRPC stream while activations come on the doorbell."""
    mailbox = Mailbox()
    _bell = _Doorbell(mailbox)
    waiter = _Waiter(mailbox, MailKey(1, GRADIENT, 0))
    y = torch.ones(2)
    assert mailbox.put(MailKey(1, GRADIENT, 0), y)
    assert waiter.join() is y


def test_a_doorbell_closed_during_a_wait_is_released_and_the_wait_goes_on(
    no_safety_poll: None,
) -> None:
    """A link replaced (a plan change) while the step waits: its doorbell goes, the wait stays
    for the new link's tensor, and a doorbell added meanwhile is read."""
    mailbox = Mailbox()
    old = _Doorbell(mailbox)
    waiter = _Waiter(mailbox, MailKey(1, ACTIVATION, 0))
    old.reader.close()
    new = _Doorbell(mailbox, handshake_index=1)  # its handshake's tensor: taken on this thread
    assert mailbox.num_sources == 1
    x = torch.arange(4.0)
    new.send(MailKey(1, ACTIVATION, 0), x)
    assert torch.equal(waiter.join(), x)


def test_duplicates_and_stale_doorbell_tensors_are_dropped() -> None:
    mailbox = Mailbox()
    bell = _Doorbell(mailbox)
    bell.send(MailKey(1, ACTIVATION, 0), torch.ones(1))
    bell.send(MailKey(1, ACTIVATION, 0), torch.zeros(1))  # a duplicate
    assert torch.equal(mailbox.get(MailKey(1, ACTIVATION, 0), _JOIN_S), torch.ones(1))
    bell.send(MailKey(1, ACTIVATION, 1), torch.ones(1))  # left unread at the run's end
    mailbox.finish(1)  # delivers what the doorbell holds, then drops the finished run's mail
    bell.send(MailKey(1, ACTIVATION, 2), torch.ones(1))  # late: stale
    bell.send(MailKey(2, ACTIVATION, 0), torch.full((1,), 2.0))
    assert torch.equal(mailbox.get(MailKey(2, ACTIVATION, 0), _JOIN_S), torch.full((1,), 2.0))
    assert mailbox.num_duplicates == 1 and mailbox.num_stale == 1
    assert len(mailbox) == 0


def test_two_stages_filling_each_others_doorbells_do_not_deadlock() -> None:
    """Each stage first sends more than a pipe holds, then takes what the other sent. A sender
    waiting for room reads its own doorbells, so neither waits for the other forever."""
    count = 3000  # ~60-byte messages: about three pipes' worth
    a, b = Mailbox(), Mailbox()
    down = _Doorbell(b, ACTIVATION, while_full=a.pump)
    up = _Doorbell(a, GRADIENT, while_full=b.pump)
    got: dict[str, list[float]] = {}

    def stage(bell: _Doorbell, sends: str, own: Mailbox) -> None:
        for i in range(count):
            bell.send(MailKey(1, sends, i), torch.full((1,), float(i)))
        takes = opposite(sends)
        got[takes] = [own.get(MailKey(1, takes, i), _JOIN_S).item() for i in range(count)]

    threads = [
        threading.Thread(target=stage, args=(down, ACTIVATION, a), daemon=True),
        threading.Thread(target=stage, args=(up, GRADIENT, b), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "the stages deadlocked on full doorbells"
    assert got == {ACTIVATION: list(range(count)), GRADIENT: list(range(count))}
