"""The job's step batcher (see [Note: continuous batching]): one loop runs the steps of every
session that wants one as one run; a slow reader pauses only its own session; a run over the
KV budget is retried session by session. Pure: the run is a function here, no stages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from pipesvc.coordinator.batcher import StepBatcher
from pipesvc.coordinator.session import ModelSupport, Session
from pipesvc.core.sampling import Sampling
from pipesvc.errors import (
    InvalidArgumentError,
    KVBudgetError,
    PipesvcError,
    ResourceExhaustedError,
    StageUnavailableError,
)

SUPPORT = ModelSupport(kv_cache=True, side_inputs=("attention_mask", "position_ids"))
TIMEOUT_S = 10.0


def session(rows: int = 1) -> Session:
    return Session(
        torch.ones(rows, 3, dtype=torch.long), None, parts=1, sampling=Sampling(), support=SUPPORT
    )


class Runs:
    """A run function that records its sessions and makes token ``run number`` for every row
    (with an optional hook per run)."""

    def __init__(self, hook: object = None) -> None:
        self.runs: list[list[Session]] = []
        self.hook = hook
        self.lock = threading.Lock()

    def __call__(
        self, sessions: list[Session], during: Callable[[], None], most: int
    ) -> list[tuple[list[list[torch.Tensor]], int]]:
        with self.lock:
            self.runs.append(list(sessions))
            number = len(self.runs)
        if callable(self.hook):
            self.hook(sessions)
        during()  # the stages have the run
        logits = torch.full((1, 64), -1.0)
        logits[0, number % 64] = 1.0
        return [([[logits.expand(len(s.rows[0]), 64)]], 1) for s in sessions]


def read_all(batcher: StepBatcher, stream: object) -> list[int]:
    out: list[int] = []
    while (made := batcher.next(stream)) is not None:  # type: ignore[arg-type]
        out.append(int(made.tokens[0]))
    return out


def test_sessions_that_keep_up_share_every_run_and_get_their_own_tokens() -> None:
    runs = Runs()
    batcher = StepBatcher(runs)
    sessions = [session() for _ in range(4)]
    gate = threading.Event()
    runs.hook = lambda _: gate.wait(TIMEOUT_S)  # every stream opens before the first run ends
    streams = [batcher.open(s, 5) for s in sessions]
    gate.set()
    results: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, read_all(batcher, streams[i])))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    for stream in streams:
        batcher.close(stream)
    # Runs are shared: 20 steps in fewer runs (the second run, after the gated first, holds
    # all four; how the rest group depends on how fast each reader reads).
    assert len(runs.runs) < 20 and len(runs.runs[1]) == 4, [len(r) for r in runs.runs]
    for i, s in enumerate(sessions):
        made = [n for n, run in enumerate(runs.runs, start=1) if s in run]
        assert results[i] == made  # the tokens of exactly the runs it was in, in order
        assert s.tokens.shape[1] == 3 + 5


def test_a_reader_that_falls_behind_pauses_only_its_own_session() -> None:
    runs = Runs()
    batcher = StepBatcher(runs, ahead=2)
    slow, quick = session(), session()
    slow_stream = batcher.open(slow, 10)
    quick_stream = batcher.open(quick, 10)
    assert len(read_all(batcher, quick_stream)) == 10  # slow's reader never reads meanwhile
    assert sum(slow in run for run in runs.runs) == 2  # made as far ahead as allowed, no more
    assert len(read_all(batcher, slow_stream)) == 10  # reading lets it go on
    for stream in (slow_stream, quick_stream):
        batcher.close(stream)


@pytest.mark.parametrize("error", [ResourceExhaustedError, InvalidArgumentError])
def test_a_shared_run_failing_on_one_session_retries_each_session_alone(
    error: type[PipesvcError],
) -> None:
    """A shared run fails on an error of the caller's kind (over a KV budget, an input a layer
    refuses): each session runs again alone, the youngest first, and only the one at fault
    fails."""
    big, small, warm = session(rows=2), session(), session()
    gate = threading.Event()

    def hook(sessions: list[Session]) -> None:
        if sessions == [warm]:
            gate.wait(TIMEOUT_S)  # big and small open meanwhile, and then run together
        elif len(sessions) > 1 or sessions[0] is big:
            raise error("over budget")

    runs = Runs(hook)
    batcher = StepBatcher(runs)
    warm_stream = batcher.open(warm, 1)
    while not runs.runs:
        time.sleep(0.01)
    streams = {s.id: batcher.open(s, 1) for s in (big, small)}
    gate.set()
    results: dict[str, object] = {}
    for s in (big, small):
        try:
            results[s.id] = read_all(batcher, streams[s.id])
        except error as exc:
            results[s.id] = exc
    assert [set(r) for r in runs.runs[1:]] == [{big, small}, {small}, {big}]
    assert isinstance(results[big.id], error)  # alone it still does not fit
    assert isinstance(results[small.id], list)  # alone it does
    for stream in [warm_stream, *streams.values()]:
        batcher.close(stream)


def test_a_failed_run_fails_its_sessions_and_close_waits_for_the_run() -> None:
    started, release = threading.Event(), threading.Event()

    def hook(_: list[Session]) -> None:
        started.set()
        release.wait(TIMEOUT_S)
        raise StageUnavailableError("stage lost for good")

    batcher = StepBatcher(Runs(hook))
    stream = batcher.open(session(), 3)
    assert started.wait(TIMEOUT_S)
    closer = threading.Thread(target=batcher.close, args=(stream,))
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # the run holding the session is still going
    release.set()
    closer.join(TIMEOUT_S)
    assert not closer.is_alive()
    errored = batcher.open(session(), 2)
    release.set()
    try:
        read_all(batcher, errored)
    except StageUnavailableError as exc:
        assert "lost for good" in str(exc)
    else:
        raise AssertionError("the failed run's error did not reach its session")
    batcher.close(errored)


def test_a_steps_tokens_reach_their_readers_once_the_next_run_is_on_the_stages() -> None:
    """The readers' work overlaps the stages' compute (see [Note: continuous batching]): a
    token is handed over when the next run's stages have it, or at once when no run follows."""
    read: list[tuple[int, float]] = []
    announced = threading.Event()
    held: dict[int, float] = {}

    def run(
        sessions: list[Session], during: Callable[[], None], most: int
    ) -> list[tuple[list[list[torch.Tensor]], int]]:
        number = len(held) + 1
        if number == 2:  # the first run's token is made; the second run is not sent yet
            time.sleep(0.3)
        held[number] = time.monotonic()
        during()
        announced.set()
        logits = torch.full((1, 64), -1.0)
        logits[0, number] = 1.0
        return [([[logits]], 1) for _ in sessions]

    batcher = StepBatcher(run, ahead=2)
    stream = batcher.open(session(), 3)
    while (made := batcher.next(stream)) is not None:
        read.append((int(made.tokens[0]), time.monotonic()))
    assert [token for token, _ in read] == [1, 2, 3]
    # Token 1 came once run 2 was on the stages, not while run 2 was being prepared.
    assert read[0][1] >= held[2]
    # The last token, with no run after it, came at once.
    assert read[2][1] - held[3] < TIMEOUT_S


def test_runs_of_several_steps_stop_at_each_sessions_limit_and_end() -> None:
    """With ``steps``, a run may take several steps (see [Note: decode steps on the stages]):
    never more than the session nearest its token limit has left, and a session whose
    end-of-sequence token comes inside a run keeps none of the run's later steps."""
    asked: list[int] = []
    opened = threading.Event()

    def run(
        sessions: list[Session], during: Callable[[], None], most: int
    ) -> list[tuple[list[list[torch.Tensor]], int]]:
        # Both sessions are open before a second run begins, however the threads are
        # scheduled: the short one shares the long one's runs from the first or the second.
        assert opened.wait(TIMEOUT_S)
        asked.append(most)
        during()
        out = []
        for s in sessions:
            base = int(s.tokens.shape[1])  # the token of step k is its length + k, mod 64
            steps = []
            for k in range(most):
                logits = torch.full((len(s.rows[0]), 64), -1.0)
                logits[:, (base + k) % 64] = 1.0
                steps.append([logits])
            out.append((steps, 1))
        return out

    # Readers never hold a session back (``ahead``): long is in every run, whenever it is read.
    batcher = StepBatcher(run, steps=4, ahead=10)
    ending = Session(
        torch.ones(1, 3, dtype=torch.long),
        None,
        parts=1,
        sampling=Sampling(),
        support=SUPPORT,
        eos_token_id=8,  # its tokens are 3, 4, ...: 8 is its 6th
    )
    long = batcher.open(session(), 10)
    short = batcher.open(ending, 20)
    opened.set()
    got_long, got_short = read_all(batcher, long), read_all(batcher, short)
    batcher.close(long)
    batcher.close(short)
    assert got_long == list(range(3, 13))
    assert got_short == [3, 4, 5, 6, 7, 8]  # none of the steps after its end
    # 10 tokens of the long session in runs of 4, 4 and the 2 it has left; the short one
    # shared the first runs and was done within them.
    assert asked == [4, 4, 2], asked


def test_a_runs_steps_each_count_a_share_of_its_time() -> None:
    """A run of several steps hands its tokens over at once; the time-per-token metric counts
    each an equal share of the run's wait, not the whole wait once and zeros after it."""
    counted: list[tuple[bool, float, int]] = []

    def run(
        sessions: list[Session], during: Callable[[], None], most: int
    ) -> list[tuple[list[list[torch.Tensor]], int]]:
        during()
        prompt = int(sessions[0].tokens.shape[1]) == 3  # a prompt's run takes one step
        time.sleep(0.0 if prompt else 0.08)
        logits = torch.zeros(2, 64)
        return [([[logits]] * (1 if prompt else most), 1) for _ in sessions]

    batcher = StepBatcher(
        run, steps=4, on_token=lambda first, seconds, rows: counted.append((first, seconds, rows))
    )
    stream = batcher.open(session(rows=2), 9)  # the prompt's run, then runs of 4 and 4
    assert len(read_all(batcher, stream)) == 9
    batcher.close(stream)
    assert [(first, rows) for first, _, rows in counted] == [(True, 2)] + [(False, 2)] * 8
    later = [seconds for _, seconds, _ in counted[1:]]
    for a, b in ((0, 4), (4, 8)):  # each run's 4 tokens: equal shares of about 80 ms
        assert len(set(later[a:b])) == 1
        assert 0.015 <= later[a] < TIMEOUT_S / 4


class Budget(Runs):
    """Runs over a KV budget counted in positions: a run fails with ``KVBudgetError`` when the
    positions its sessions would hold after it (each session's tokens so far), with those the
    other sessions hold, pass ``limit``; nothing changes then. ``release`` and ``evict`` drop a
    session's positions, as the stages drop its caches."""

    def __init__(self, limit: int) -> None:
        super().__init__(self.check)
        self.limit = limit
        self.held: dict[Session, int] = {}
        self.evicted: list[Session] = []

    def check(self, sessions: list[Session]) -> None:
        need = {s: int(s.tokens.shape[1]) for s in sessions}
        others = sum(n for s, n in self.held.items() if s not in need)
        if others + sum(need.values()) > self.limit:
            raise KVBudgetError(f"{others + sum(need.values())} positions over {self.limit}")
        self.held.update(need)

    def release(self, session: Session) -> None:
        self.held.pop(session, None)

    def evict(self, session: Session) -> None:
        self.evicted.append(session)
        self.release(session)
        session.invalidate()


def _two_sessions(
    limit: int,
) -> tuple[Budget, dict[Session, list[int]], dict[Session, BaseException]]:
    """An older and a younger session of 3 prompt tokens and 6 new ones over a budget of
    ``limit`` positions, sharing every run (a warm-up session outside the budget holds the loop
    until both are open; readers never hold either back), each read to its end, or its error,
    and closed by a thread of its own. Returns the budget, each one's tokens and
    each failed one's error (keyed older first)."""
    budget = Budget(limit)
    batcher = StepBatcher(budget, ahead=10, release=budget.release, evict=budget.evict)
    older, younger, warm = session(), session(), session()
    gate = threading.Event()
    budget.hook = lambda sessions: (
        gate.wait(TIMEOUT_S) if sessions == [warm] else budget.check(sessions)
    )
    warm_stream = batcher.open(warm, 1)
    while not budget.runs:
        time.sleep(0.01)
    streams = {older: batcher.open(older, 6)}
    streams[younger] = batcher.open(younger, 6)
    gate.set()
    made: dict[Session, list[int]] = {older: [], younger: []}
    failed: dict[Session, BaseException] = {}

    def reader(s: Session) -> None:
        try:
            while (step := batcher.next(streams[s])) is not None:
                made[s].append(int(step.tokens[0]))
        except KVBudgetError as exc:
            failed[s] = exc
        batcher.close(streams[s])

    threads = [threading.Thread(target=reader, args=(s,)) for s in (older, younger)]
    for t in threads:
        t.start()
    assert len(read_all(batcher, warm_stream)) == 1
    batcher.close(warm_stream)
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    return budget, made, failed


def test_a_session_over_the_kv_budget_waits_for_another_to_close_then_goes_on() -> None:
    """See [Note: waiting for room]: two sessions that share every run fit a budget of 15
    positions until their sixth step (8 + 8). Alone, the younger goes first and fits (7 + 8);
    the older's caches are dropped and it waits until the younger closes, then replays and
    makes its last token: both make all 6, neither fails."""
    budget, made, failed = _two_sessions(15)
    older, younger = made
    assert not failed
    assert [len(made[older]), len(made[younger])] == [6, 6]
    # Only the older waits; it may go again and wait once more if the warm-up session closed
    # while it waited (a close may have freed room), before the younger closes.
    assert budget.evicted and set(budget.evicted) == {older}
    # Its last run came after the younger closed, alone, replaying its 8 tokens.
    assert budget.runs[-1] == [older] and budget.held == {}


def test_a_session_over_the_kv_budget_fails_when_no_other_would_free_room() -> None:
    """Alone, a session that does not fit fails with the budget's error. Beside only a waiting
    session it fails too, rather than both waiting for each other: in a budget of 7 positions
    the older of two sessions waits at their second step, the younger fails at its sixth, and
    the older, going on alone once the younger closed, fails at its own sixth."""
    budget = Budget(6)
    batcher = StepBatcher(budget, release=budget.release, evict=budget.evict)
    alone = batcher.open(session(), 6)
    with pytest.raises(KVBudgetError, match="over 6"):
        read_all(batcher, alone)
    batcher.close(alone)
    assert budget.held == {} and budget.evicted == []

    budget, made, failed = _two_sessions(7)
    older, younger = made
    assert set(failed) == {older, younger}
    assert [len(made[older]), len(made[younger])] == [5, 5]  # the sixth never fits
    # The older waited first. Either may wait again at its sixth step when another session
    # closed during that run (the warm-up one, whenever its reader closes it): a close since
    # a run began may have freed room, so the session goes again before it fails.
    assert budget.evicted[0] is older and set(budget.evicted) <= {older, younger}
    assert budget.held == {}


def test_a_waiting_session_goes_on_before_sessions_opened_after_it() -> None:
    """While a session waits for room, a session opened meanwhile does not start (it holds no
    caches, so nothing waits for it): it starts after the waiting one's replay, so new sessions
    cannot starve one that waits."""
    budget = Budget(15)
    older, younger, warm, late = session(), session(), session(), session()
    gate = threading.Event()
    budget.hook = lambda sessions: (
        gate.wait(TIMEOUT_S) if sessions == [warm] else budget.check(sessions)
    )
    streams: dict[Session, object] = {}
    made: dict[Session, list[int]] = {}

    def reader(s: Session) -> None:
        made[s] = read_all(batcher, streams[s])
        batcher.close(streams[s])  # type: ignore[arg-type]

    threads: list[threading.Thread] = []
    evict = budget.evict

    def evict_then_open(s: Session) -> None:
        evict(s)
        if late in streams:
            return
        streams[late] = batcher.open(late, 2)
        threads.append(threading.Thread(target=reader, args=(late,)))
        threads[-1].start()

    budget.evict = evict_then_open  # type: ignore[method-assign]
    batcher = StepBatcher(budget, ahead=10, release=budget.release, evict=budget.evict)
    warm_stream = batcher.open(warm, 1)
    while not budget.runs:
        time.sleep(0.01)
    streams[older] = batcher.open(older, 6)
    streams[younger] = batcher.open(younger, 6)
    gate.set()
    threads += [threading.Thread(target=reader, args=(s,)) for s in (older, younger)]
    for t in threads[-2:]:
        t.start()
    assert len(read_all(batcher, warm_stream)) == 1
    batcher.close(warm_stream)
    deadline = time.monotonic() + TIMEOUT_S
    while len(made) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    for t in threads:
        t.join(TIMEOUT_S)
    assert [len(made.get(s, [])) for s in (older, younger, late)] == [6, 6, 2]
    assert budget.evicted and set(budget.evicted) == {older}
    replay = budget.runs.index([older])  # its first run alone: the replay
    assert all(late not in run for run in budget.runs[:replay])
