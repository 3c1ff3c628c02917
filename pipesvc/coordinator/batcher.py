"""Continuous batching of a job's generation sessions: one loop runs every session's steps.

[Note: continuous batching] A job's sessions do not each drive their own steps. Each opens a
stream on the job's ``StepBatcher``; one loop (a thread that lives while any stream is open)
repeats: take every session that wants a step, run one step of all of them as one GENERATE run
(``run``: ``plan_step`` and the stages, under the job's lock, so training steps go in between),
pick each session's tokens and put them on its stream. A session wants a step while it has
tokens left to make, has not finished, and its reader is at most ``ahead`` runs' tokens behind
(a run may take several steps: [Note: decode steps on the stages] in session.py), so a client
that reads slowly pauses only its own session and never holds the others back, and
sessions that keep up share every run (sessions join and leave between runs). A step's tokens
are handed to their readers once the next run is on the stages (``_announce``, called from the
run): the readers' work (a gRPC reply each, an HTTP chunk) then overlaps the stages' compute
instead of delaying the next run's start. In a run a part
that starts its cache (a prompt, a replay) is a micro-batch of its own, and the decode parts of
all the sessions share one (see [Note: fused decode] in ``pipesvc.stage.compute.fused_cache``), so
each stage reads its weights once per step for all of them. When a shared run fails on an error of
the caller's kind (a KV budget, an input a layer refuses), each session's step runs again alone,
so only the sessions at fault fail: the stages put every session of the failed run back as it
was (see [Note: session runs] in ``pipesvc.stage.compute.sessions``), so the others lose nothing. No
gRPC here.

[Note: waiting for room] A session whose step alone would take a stage's key/value caches past
its ``--kv-budget`` (``KVBudgetError``) while other sessions are open does not fail: its caches
are dropped on every stage (``evict``) and it waits until another session has closed (``close``
drops that one's caches first, ``release``), then replays its tokens into fresh caches and goes
on with the same tokens, as a session whose caches expired does. This is vLLM's preemption by
recomputation: a busy server makes a session that arrives, or grows, into a full budget wait
instead of ending it halfway through its tokens. When a shared run does not fit, its sessions
go again alone youngest first, so the youngest is the one that waits while older ones go on.
A session fails with the budget's error, sizes and all, only when no other session would free
anything: it is alone, or every other one waits too (so waiting sessions never wait for each
other). A session that made its last token but whose reader has not closed it yet still holds
its caches, so it counts as one that will free room. While a session waits, sessions that have
not started yet do not start (they hold no caches, so they are not waited for either): a waiting
session goes on before anything that came after it, and a stream of new ones cannot starve it.
A waiting session has no token to send, so its client going away is not seen by a failed send:
the Generate call's cancellation and the HTTP API's check for a gone client (every
``GONE_POLL_S`` until the first token) call ``leave``, so it takes no further step and never runs
for nobody.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipesvc.coordinator.session import Made, Session
from pipesvc.errors import (
    InvalidArgumentError,
    KVBudgetError,
    PipesvcError,
    ResourceExhaustedError,
)

logger = logging.getLogger(__name__)

RunSteps = Callable[
    [list[Session], Callable[[], None], int], list[tuple[list[list[torch.Tensor]], int]]
]
"""Runs one step of each session as one GENERATE run, or up to the third argument's steps (see
[Note: decode steps on the stages] in session.py), calling the second argument once the stages
have the run (it must not raise); returns, per session, each step's part logits and the plan
epoch they were computed in."""

OnToken = Callable[[bool, float, int], None]
"""Told of each step a session made: whether it was the first, its seconds, and its rows."""


@dataclass(eq=False)
class TokenStream:
    """One session's place in the batcher: its tokens made and not yet read."""

    session: Session
    steps_left: int
    changed: threading.Condition
    """Notified when it has tokens, an error, or is no longer in a run (on the batcher's lock)."""
    made: deque[Made] = field(default_factory=deque)
    told: int = 0
    """How many of ``made`` its reader may take (see ``StepBatcher._announce``)."""
    error: BaseException | None = None
    closed: bool = False
    running: bool = False
    """A run holding this session is going."""
    steps: int = 0
    since: float = field(default_factory=time.monotonic)
    """When its last step was asked for (or made)."""
    parked: int | None = None
    """While it waits for room in the KV budgets: the batcher's count of closed sessions when
    it began to (see [Note: waiting for room])."""
    opened: float = field(default_factory=time.monotonic)
    """When it opened: of a shared run that does not fit, the youngest waits first."""
    started: bool = False
    """A run has taken it (it may hold caches on the stages)."""

    @property
    def finished(self) -> bool:
        return self.closed or self.error is not None or self.steps_left == 0 or self.session.done


class StepBatcher:
    """Runs the steps of a job's sessions (see [Note: continuous batching])."""

    def __init__(
        self,
        run: RunSteps,
        *,
        max_parts: int = 256,
        ahead: int = 2,
        on_token: OnToken | None = None,
        steps: int = 1,
        release: Callable[[Session], None] | None = None,
        evict: Callable[[Session], None] | None = None,
    ) -> None:
        self._run = run
        self._release = release
        """Drops a closed session's caches on the stages (best effort: it must not raise)."""
        self._evict = evict
        """Drops a waiting session's caches on the stages, so that it replays its tokens on its
        next step (see [Note: waiting for room]); it must not raise."""
        self._max_parts = max_parts
        self._steps = steps
        """The most steps one run may take."""
        self._ahead = ahead * steps
        """Tokens a reader may be behind (``ahead`` runs' worth)."""
        self._on_token = on_token
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        """The loop's: notified when a stream opens, closes or is read."""
        self._streams: list[TokenStream] = []
        self._loop: threading.Thread | None = None
        self._ended = 0
        """Sessions closed, their caches dropped: a waiting one asks again when this grows (see
        [Note: waiting for room])."""
        self._unannounced: list[TokenStream] = []
        """Streams given tokens whose readers are not told yet (see ``_announce``)."""

    def open(self, session: Session, steps: int) -> TokenStream:
        """Starts making up to ``steps`` tokens of ``session``."""
        stream = TokenStream(session, steps, threading.Condition(self._lock))
        with self._cond:
            self._streams.append(stream)
            if self._loop is None:
                self._loop = threading.Thread(target=self._serve, name="step-batcher", daemon=True)
                self._loop.start()
            self._cond.notify_all()
        return stream

    def next(self, stream: TokenStream) -> Made | None:
        """The session's next step (its tokens, ``[B]``), waiting for it; None once it has made
        all it will.

        Raises:
            PipesvcError: its step failed (the session is over).
        """
        with self._cond:
            while not stream.told and not stream.finished:  # an error finishes it too
                stream.changed.wait()
            if stream.made:
                stream.told = max(stream.told - 1, 0)
                made = stream.made.popleft()
                self._cond.notify()  # its session may want a step again
                return dataclasses.replace(made, more=stream.told > 0)
            if stream.error is not None:
                raise stream.error
            return None

    def leave(self, stream: TokenStream) -> bool:
        """The session's reader is gone (from any thread): it takes no further step, and a
        reader waiting in ``next`` gets what was made, then the end. ``close`` still drops its
        caches, from the thread that reads it. Returns whether it would have gone on."""
        with self._cond:
            going = not stream.finished
            stream.closed = True
            stream.changed.notify_all()
            self._cond.notify_all()
        return going

    def close(self, stream: TokenStream) -> None:
        """Ends the session's stream: once no run holds it, drops its caches (``release``)."""
        with self._cond:
            stream.closed = True
            while stream.running:
                stream.changed.wait()
        if self._release is not None:
            self._release(stream.session)
        with self._cond:
            if stream in self._streams:
                self._streams.remove(stream)
            self._ended += 1
            self._cond.notify()

    def _wants_step(self, stream: TokenStream) -> bool:
        if stream.parked is not None:
            if stream.parked == self._ended:
                return False  # waiting for room (see [Note: waiting for room])
        elif not stream.started and any(s.parked is not None for s in self._streams):
            return False  # new ones start after the waiting ones
        return not stream.finished and len(stream.made) < self._ahead

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (ready := [s for s in self._streams if self._wants_step(s)]):
                    self._announce_locked()
                    if not self._streams:
                        self._loop = None
                        return
                    self._cond.wait()
                group = self._take(ready)
                for stream in group:
                    stream.running = True
                    stream.started = True
                    stream.parked = None
            try:
                self._run_group(group)
            finally:
                with self._cond:
                    for stream in group:
                        stream.running = False
                        stream.changed.notify_all()

    def _announce(self) -> None:
        """Tells the readers of the last step's tokens (see [Note: continuous batching])."""
        with self._lock:
            self._announce_locked()

    def _announce_locked(self) -> None:
        for stream in self._unannounced:
            stream.told = len(stream.made)
            stream.changed.notify_all()
        self._unannounced.clear()

    def _take(self, ready: list[TokenStream]) -> list[TokenStream]:
        """The sessions of the next run: the ready ones up to ``max_parts`` parts, those waiting
        longest first; the ones left move to the back of the line."""
        ready.sort(key=lambda s: s.since)
        group: list[TokenStream] = []
        parts = 0
        for stream in ready:
            size = len(stream.session.rows)
            if group and parts + size > self._max_parts:
                break
            group.append(stream)
            parts += size
        return group

    def _run_group(self, group: list[TokenStream]) -> None:
        ended = self._ended  # sessions closed before the run (see ``_wait_or_fail``)
        try:
            results = self._run([s.session for s in group], self._announce, self._most(group))
        except (ResourceExhaustedError, InvalidArgumentError) as exc:
            self._announce()  # the run failed, perhaps before its stages had it
            if len(group) == 1:
                self._wait_or_fail(group[0], exc, ended)
                return
            # Alone, so that only the sessions at fault fail; the youngest first, so that it is
            # the one that waits for room (see [Note: waiting for room]).
            for stream in sorted(group, key=lambda s: s.opened, reverse=True):
                ended = self._ended
                try:
                    alone = self._run([stream.session], self._announce, self._most([stream]))
                    self._made([stream], alone)
                except PipesvcError as alone:
                    self._wait_or_fail(stream, alone, ended)
            return
        except BaseException as exc:  # every session of the run sees its error
            self._announce()
            for stream in group:
                self._fail(stream, exc)
            return
        self._made(group, results)

    def _most(self, group: list[TokenStream]) -> int:
        """The most steps a run of ``group`` may take: none past any session's token limit."""
        return max(1, min([self._steps] + [s.steps_left for s in group]))

    def _made(
        self, group: list[TokenStream], results: list[tuple[list[list[torch.Tensor]], int]]
    ) -> None:
        """Picks each session's tokens from each step's logits and hands them to its stream;
        the steps after a session's last are dropped (see [Note: decode steps on the stages]
        in session.py)."""
        tokened: list[tuple[TokenStream, list[Made]]] = []
        for stream, (steps, epoch) in zip(group, results, strict=True):
            made: list[Made] = []
            for logits in steps:
                if stream.steps_left - len(made) <= 0 or stream.session.done:
                    break
                tokens = stream.session.advance(logits, epoch)
                if tokens is None:
                    # A prompt's first chunks only, no token yet (see [Note: chunks between
                    # decode steps] in session.py); its time to first token runs on.
                    break
                made.append(Made(tokens, stream.session.last_logprobs))
            if made:
                tokened.append((stream, made))
        now = time.monotonic()
        with self._lock:
            for stream, made in tokened:
                stream.made.extend(made)
                stream.steps += len(made)
                stream.steps_left -= len(made)
                # A stream that needs no further step is told now: no run would tell it.
                if self._wants_step(stream):
                    self._unannounced.append(stream)
                else:
                    stream.told = len(stream.made)
                    stream.changed.notify_all()
        if self._on_token is not None:
            for stream, made in tokened:
                first = stream.steps == len(made)
                waited = now - stream.since
                # A run's tokens all came at ``now``: each of its steps counts an equal share
                # of the wait, so a run of 4 steps records 4 times of a quarter, as 4 runs of
                # one step would, not one time and three zeros.
                for index, one in enumerate(made):
                    seconds = waited if first and index == 0 else waited / len(made)
                    self._on_token(first and index == 0, seconds, int(one.tokens.shape[0]))
        for stream, _ in tokened:
            stream.since = now

    def _wait_or_fail(self, stream: TokenStream, error: BaseException, ended: int) -> None:
        """Fails the session, or for a KV budget error makes it wait while another session
        may still free room (see [Note: waiting for room]). ``ended``: the count of closed
        sessions before the run that failed; one closed since has freed room already, so the
        session goes again at once."""
        with self._lock:
            # A session still listed has not dropped its caches yet: one closing drops them
            # before it leaves the list.
            waits = isinstance(error, KVBudgetError) and (
                self._ended != ended
                or any(
                    other is not stream and other.started and other.parked is None
                    for other in self._streams
                )
            )
        if not waits:
            self._fail(stream, error)
            return
        logger.info("a session waits for room in the KV budgets: %s", error)
        if self._evict is not None:
            self._evict(stream.session)
        with self._lock:
            stream.parked = ended

    def _fail(self, stream: TokenStream, error: BaseException) -> None:
        with self._lock:
            stream.error = error
            stream.changed.notify_all()
