"""One ``Train`` call on the coordinator: a client's stream of training steps, pipelined.

[Note: pipelined steps] With ``TrainStep`` the stages wait, between two steps, for the reply to
reach the client, the client to encode its next batch and send it, and the coordinator to
decode, check and split it. ``Train`` takes that off the path: the client streams its batches
ahead (``pipesvc.wire.step_stream``, at most ``TRAIN_WINDOW`` unreplied), and the coordinator
runs three threads per call:

- a reader decodes, checks and splits each request as it arrives (``JobDriver.prepare_step``,
  which touches nothing of the job's), so step N+1 is ready while step N runs;
- a worker runs the prepared steps one after another through ``JobDriver.train_prepared``,
  the same function ``TrainStep`` uses: the job's lock per step, the step log, the decision,
  the database row and the remembered request id, so every guarantee of ``TrainStep`` holds
  step by step (see [Note: commit], [Note: recovery] and [Note: step request ids]). Step
  N+1's run, which carries N's commit (see [Note: deferred commit]), goes to the stages
  before N is decided: as soon as N's log entry is written and N+1 is prepared, the reader
  waking the worker if N+1 comes while N's run is out (``Upcoming``, and [Note: steps ahead]
  in step_runner.py);
- the call's own thread builds and sends each reply, in order, while the worker is already
  running the next step.

A step that fails ends the call with its typed error after the replies of the steps before
it; the worker runs nothing after it, and steps the reader prepared beyond it are dropped
(never logged, never run). A cancelled call (the client went away or stopped iterating) lets
the step running finish (a step is decided whole or aborted whole) and runs no further one;
a client that reconnects sends its unreplied steps again under the same request ids, and a
step that was decided is answered with its first result. A coordinator that stops gracefully
interrupts its streams the same way before it waits for the job's last step and closes its
database, and ends each as UNAVAILABLE, which the client takes as a lost call.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)

PREPARED_AHEAD = 4
"""Steps the reader prepares ahead of the worker at most (a client sends fewer: this bounds
what a client that ignores the window can make the coordinator hold)."""

_Result = TypeVar("_Result")
_Reply = TypeVar("_Reply")
_Request = TypeVar("_Request")
_Item = TypeVar("_Item")
_Seen = TypeVar("_Seen")

Wake = Callable[[], None]


class Upcoming(Generic[_Item]):
    """A stream's next step as the running step sees it, so that its run may go ahead (see
    [Note: steps ahead] in step_runner.py). Called, it gives the next step if it is prepared
    already (it then runs next), or None: not yet, or none will come. ``watch`` names the one
    callback to call, from the reader's thread, whenever that may have changed: a step that
    arrives while the running one's run is out can still go ahead of its decision."""

    def __init__(
        self, peek: Callable[[], _Item | None], watch: Callable[[Wake | None], None]
    ) -> None:
        self._peek, self._watch = peek, watch

    def __call__(self) -> _Item | None:
        return self._peek()

    def watch(self, wake: Wake | None) -> None:
        """Has ``wake`` called whenever the next step may have become prepared (None: no
        callback); it replaces the one watching before."""
        self._watch(wake)

    def map(self, seen: Callable[[_Item], _Seen | None]) -> Upcoming[_Seen]:
        """The same next step as ``seen`` makes of it (None: it may not go ahead)."""

        def peek() -> _Seen | None:
            item = self._peek()
            return None if item is None else seen(item)

        return Upcoming(peek, self._watch)


class Step(Protocol[_Result]):
    """A prepared step."""

    def __call__(self, ahead: Upcoming[Step[_Result]] | None) -> _Result:
        """Runs it and returns its result; ``ahead``: a stream's next step (see
        ``Upcoming``)."""
        ...

    def end(self) -> None:
        """The stream ran this step last and runs no other."""
        ...


class _End:
    """The end of a queue's items."""


_END = _End()


class TrainStream(Generic[_Request, _Result, _Reply]):
    """A stream of training steps: ``prepare`` turns each request into a step (raising if it
    is invalid), the steps run one after another, and ``replies()`` yields ``reply`` of each
    result, in order, raising the first error at the step that failed."""

    def __init__(
        self,
        requests: Iterator[_Request],
        *,
        prepare: Callable[[_Request], Step[_Result]],
        reply: Callable[[_Result], _Reply],
        name: str = "train",
    ) -> None:
        self._requests = requests
        self._prepare = prepare
        self._reply = reply
        self._stopped = threading.Event()
        self.interrupted = False
        """Stopped by ``interrupt`` (the coordinator stopping)."""
        self._prepared: queue.Queue[Step[_Result] | BaseException | _End] = queue.Queue(
            PREPARED_AHEAD
        )
        self._results: queue.Queue[_Result | BaseException | _End] = queue.Queue()
        self._taken: Step[_Result] | BaseException | _End | None = None
        """The next item, taken from the queue by ``_peek``."""
        self._wake: Wake | None = None
        """Called by the reader after it queues an item (``Upcoming.watch``)."""
        self._upcoming = Upcoming(self._peek, self._set_wake)
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._worker = threading.Thread(target=self._work, name=f"{name}-worker", daemon=True)

    def stop(self) -> None:
        """No step starts after this (the one running finishes); for a cancelled call."""
        self._stopped.set()

    def interrupt(self) -> None:
        """``stop`` for a coordinator that is stopping: ``interrupted`` tells the call to end
        as unavailable, so the client sends its unreplied steps again to the next one."""
        self.interrupted = True
        self.stop()

    def replies(self) -> Iterator[_Reply]:
        """Each step's reply as it is decided; raises the failed step's error, then ends."""
        self._reader.start()
        self._worker.start()
        try:
            while True:
                item = self._results.get()
                if isinstance(item, _End):
                    return
                if isinstance(item, BaseException):
                    raise item
                yield self._reply(item)
        finally:
            self.stop()

    def _put(self, item: Step[_Result] | BaseException | _End) -> bool:
        """Queues a prepared step for the worker, and wakes a step that watches for it; False
        once the stream is stopped."""
        while not self._stopped.is_set():
            try:
                self._prepared.put(item, timeout=0.1)
            except queue.Full:
                continue
            wake = self._wake
            if wake is not None:
                wake()
            return True
        return False

    def _set_wake(self, wake: Wake | None) -> None:
        self._wake = wake

    def _read(self) -> None:
        try:
            for request in self._requests:
                try:
                    step = self._prepare(request)
                except Exception as exc:  # this step's error, raised when its turn comes
                    self._put(exc)
                    return
                if not self._put(step):
                    return
        except Exception as exc:  # the call ended under the reader (cancelled, or gone)
            if not self._stopped.is_set():
                logger.info("a training stream ended while reading: %s", exc)
        finally:
            self._put(_END)

    def _next(self) -> Step[_Result] | BaseException | _End | None:
        """The next prepared item: the one ``_peek`` took, or the queue's (None: none yet)."""
        taken, self._taken = self._taken, None
        if taken is not None:
            return taken
        try:
            return self._prepared.get(timeout=0.1)
        except queue.Empty:
            return None

    def _peek(self) -> Step[_Result] | None:
        """The next step if it is prepared already (it runs next), for a step to send ahead;
        None once the stream is stopped."""
        if self._taken is None:
            try:
                self._taken = self._prepared.get_nowait()
            except queue.Empty:
                return None
        taken = self._taken
        if self._stopped.is_set() or isinstance(taken, (BaseException, _End)):
            return None
        return taken

    def _work(self) -> None:
        last: Step[_Result] | None = None
        try:
            while not self._stopped.is_set():
                item = self._next()
                if item is None:
                    continue
                if isinstance(item, _End):
                    return
                if isinstance(item, BaseException) or self._stopped.is_set():
                    if isinstance(item, BaseException):
                        self._results.put(item)
                    return
                last = item
                try:
                    result = item(self._upcoming)
                except Exception as exc:
                    self._results.put(exc)
                    return
                self._results.put(result)
        finally:
            if last is not None:
                try:
                    last.end()
                except Exception:
                    logger.exception("ending a training stream's last step")
            self._stopped.set()  # the reader stops queueing steps nobody will run
            self._results.put(_END)
