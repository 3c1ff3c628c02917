"""When a job measures its stages, and whether it moves to the plan the measurement found.

No I/O here: the coordinator feeds in each step's wall time, the plan epoch and the stages that
could take part, and the predicted bottlenecks of a measurement (see
``core/planning/throughput.py``).

[Note: settling] A plan found from a measurement is only as good as the measurement, and a
move costs real time (a checkpoint of the whole job, loading it into the new plan, a slow
first step). On a host whose cores the stages share, measurements of one unchanged cluster
taken on two plans differed by up to 2x per stage, so a job that moved whenever a fresh
measurement predicted a faster plan moved every third step and ran no faster than the plan it
started on. So a plan settles:

- **When to measure.** A plan nothing has measured yet (a job's first; one that recovery, a
  restart or a lost stage put in place) after ``probe_steps`` steps (``partition=
  "throughput"``). A plan the job moved to, ``window`` steps after its first (which warms up
  and is left out), to check the move. Then only when the cluster may have changed: the
  median of the last ``window`` step times leaves the settled one by more than ``change``
  either way (a stage slowed down or sped up), or a stage that could take part joined or left;
  and every ``every`` steps with ``rebalance``.
- **Clearly better.** A measurement predicts how much faster the best plan would be. A plan
  is taken only if that gain exceeds, by ``min_gain`` (the hysteresis), the median gain that
  earlier measurements of the same plan predicted (0 on a plan's first measurement and after
  a stage joined or left). Measuring one plan again on an unchanged cluster, or on a cluster
  that slowed down or sped up as a whole, predicts about the same gain, whatever the
  measurements' bias; a stage that alone slowed or sped up changes it. (A measurement taken
  because the step time changed is not counted among those earlier ones: the stages' timings
  are running means, so it may be taken mid-change.) On a plan measured before, one such
  measurement is not enough: a second, ``confirm_steps`` steps later, must find it clearly
  better too, and the smaller gain counts (on a loaded host, single measurements of one plan
  predicted gains from 18% to 65%).
- **Did the last move hold?** The check compares the median step time after a move with the
  one before it. A move that did not get at least ``min_gain / 2`` faster did not hold: the
  next needs twice the margin, and there is no move back at once (the check's measurement,
  which predicts the way back, is the new plan's settled gain).
- **Paying for itself.** A move's cost is its measured wall time (measuring, checkpoint, load)
  plus its first step's excess over the settled step time. A move must be predicted to save
  that cost (of the last move) within ``payback_steps`` steps; and unless its step time or
  its stages changed, it comes no sooner after the last move than the steps the last move
  needed to save its own cost at its measured gain (``payback_steps`` if it saved nothing).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass

PROBE_STEPS = 3
"""Training steps a plan nothing measured yet runs before the job measures it."""
REBALANCE_EVERY = 20
"""Steps between measurements of a job with ``rebalance`` on."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The margins of [Note: settling]."""

    probe: bool = True
    """Measure a plan nothing has measured yet (``partition="throughput"``)."""
    every: int | None = None
    """Measure every this many steps on one plan (``rebalance``); None: never by count."""
    probe_steps: int = PROBE_STEPS
    min_gain: float = 0.1
    """The hysteresis: how much more gain than when settled a plan must be predicted."""
    change: float = 0.3
    """A step time this share slower, or faster by 1 / (1 + change), than the settled one
    has the job measure again."""
    window: int = 5
    """Steps whose median is the step time."""
    payback_steps: int = 50
    """A move must pay the last move's cost back within this many steps."""
    confirm_steps: int = 3
    """Steps between a measurement finding a clearly better plan and the one confirming it."""
    """A move must pay the last move's cost back within this many steps."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What ``Settler.decide`` concluded, and why (for the log)."""

    move: bool
    reason: str


@dataclass(slots=True)
class _Move:
    gain: float
    """Its predicted gain: 1 - predicted bottleneck / measured bottleneck before."""
    before_s: float
    """The median step time on the plan it left."""
    cost_s: float
    realized: float | None = None
    """The measured gain, once checked."""

    def payback_steps(self, horizon: int) -> int | float:
        """Steps on its plan by which it paid its cost back at its measured gain (``horizon``
        while unchecked or if it did not pay)."""
        saved = self.before_s * (self.realized or 0.0)
        return math.ceil(self.cost_s / saved - 1e-9) if saved > 0 else horizon


class Settler:
    """The state of [Note: settling] for one job: ``step`` after every committed step says
    whether to measure; ``decide`` after that measurement says whether to move; ``moved`` (or
    ``replanned``, for a move the user asked for) records a move that happened."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._epoch: int | None = None  # the plan the counters below are about
        self._expected: int | None = None  # the epoch a recorded move gave the job
        self._times: list[float] = []  # step times on this plan, its first included
        self._members: frozenset[str] | None = None
        self._joined = False  # a candidate stage joined or left since the last measurement
        self._settled_s: float | None = None  # the settled step time on this plan
        self._gains: list[float] = []  # what measurements of this plan predicted
        self._last: _Move | None = None  # the newest move, while the plan is its own
        self._pending: _Move | None = None  # the move the last decision asked for
        self._checking = False  # on a recorded move's plan, not yet checked
        self._settled = False  # this plan was measured or checked
        self._reason = ""  # why the pending measurement was asked for
        self._suspect: tuple[float, str] | None = None  # a clearly better gain, unconfirmed
        self._suspect_at = 0  # when it was measured (steps on the plan)

    @property
    def last_realized(self) -> float | None:
        """The measured gain of the newest move, once checked."""
        return None if self._last is None else self._last.realized

    def step(self, epoch: int, took_s: float, members: Collection[str]) -> str | None:
        """A training step on plan ``epoch`` took ``took_s``, with ``members`` the stages that
        could take part (the job's and the free ones); returns why to measure now, or None."""
        policy = self.policy
        if epoch != self._epoch:
            ours = epoch == self._expected
            self._epoch, self._expected = epoch, None
            self._times, self._settled_s, self._gains = [], None, []
            self._checking, self._settled, self._suspect = ours, False, None
            if not ours:  # a plan nothing here chose: recovery or a restart put it in place
                self._last = None
        self._times.append(took_s)
        self._joined |= self._members is not None and frozenset(members) != self._members
        self._members = frozenset(members)
        on_plan = len(self._times)
        if self._checking:
            if on_plan == policy.window + 1:
                return self._ask("check")
            if on_plan > policy.window + 1:  # the check's measurement failed: settle anyway
                self._check(None)
            return None
        if not self._settled:
            if policy.probe:
                return self._ask("probe") if on_plan == policy.probe_steps else None
            if on_plan <= policy.window:
                return None
            self._settle(None)  # settled as it is, unmeasured
        if self._suspect is not None:
            if on_plan < self._suspect_at + policy.confirm_steps:
                return None
            self._suspect_at = on_plan  # asked again this much later if the measurement fails
            return self._ask("confirm")
        if on_plan <= policy.window + 1:
            self._settled_s = self._recent()  # the settled step time is still forming
        elif self._joined:
            return self._ask("stages joined or left")
        else:
            now, then = self._recent(), self._settled_s
            if now is not None and then is not None and _changed(now, then, policy.change):
                return self._ask(f"step time {now:.3f} s, settled at {then:.3f} s")
        if policy.every and on_plan % policy.every == 0:
            return self._ask("periodic")
        return None

    def decide(self, current_s: float, best_s: float) -> Verdict:
        """After the measurement ``step`` asked for: whether to move from the plan measured
        at ``current_s`` seconds per micro-batch (its slowest stage) to the one predicted at
        ``best_s``."""
        policy, reason, last = self.policy, self._reason, self._last
        self._joined = False
        gain = 1 - best_s / current_s if math.isfinite(current_s) and current_s > 0 else 0.0
        if reason == "check":
            return self._check(gain)
        suspect, self._suspect = self._suspect, None
        step_s = self._recent() or 0.0
        # What the plan found now gains beyond what measurements of this plan found before
        # (their median): a cluster that slowed down or sped up as a whole changes neither.
        before = self._gains if reason != "stages joined or left" else []
        base = statistics.median(before) if before else 0.0
        self._settle(None)
        margin = policy.min_gain
        held = last is None or last.realized is None or last.realized >= policy.min_gain / 2
        if not held:
            margin *= 2  # the last move's prediction proved wrong here: ask for more
        now = f"{reason}: predicted {gain:.0%} faster"
        if before:
            now += f" ({base:.0%} before)"
        if gain - base < margin:
            if not reason.startswith("step time"):  # one taken mid-change would skew them
                self._gains.append(gain)  # one more measurement of the plan as it settled
            return Verdict(False, f"{now}; not {margin:.0%} better")
        first = suspect[1] if suspect is not None else reason
        if last is not None:
            if step_s * gain * policy.payback_steps < last.cost_s:
                return Verdict(
                    False,
                    f"{now}; saving {1e3 * step_s * gain:.1f} ms a step would not pay a "
                    f"move's {last.cost_s:.2f} s back in {policy.payback_steps} steps",
                )
            due = last.payback_steps(policy.payback_steps)
            if first == "periodic" and len(self._times) < due:  # nothing says it changed
                return Verdict(False, f"{now}; the last move pays for itself after {due} steps")
        if suspect is not None:
            gain = min(gain, suspect[0])
        elif before:
            # A plan measured before: one measurement clearly better may be noise.
            self._suspect, self._suspect_at = (gain, reason), len(self._times)
            return Verdict(False, f"{now}; to be confirmed in {policy.confirm_steps} steps")
        self._pending = _Move(gain=gain, before_s=step_s, cost_s=0.0)
        return Verdict(True, now)

    def moved(self, epoch: int, cost_s: float) -> None:
        """The job moved as the last ``decide`` said, to plan ``epoch``, in ``cost_s`` seconds
        (measuring and moving)."""
        if self._pending is not None:
            self._last, self._pending = self._pending, None
            self._last.cost_s = cost_s
            self._expected = epoch

    def replanned(self, epoch: int) -> None:
        """The user moved the job to plan ``epoch``: it is checked like a move of ours, but
        nothing predicted its gain."""
        self._last, self._pending = None, None
        self._expected = epoch

    def _ask(self, reason: str) -> str:
        self._reason = reason
        return reason

    def _check(self, gain: float | None) -> Verdict:
        """A recorded move's plan ran ``window`` steps after its first: did its gain hold?
        ``gain``: what a measurement of the plan now predicts another plan would gain."""
        last, policy = self._last, self.policy
        after = statistics.median(self._times[1:])
        self._checking = False
        self._settle(gain)
        if last is None:
            return Verdict(False, f"check: {after:.3f} s a step")
        last.realized = 1 - after / last.before_s if last.before_s > 0 else 0.0
        last.cost_s += max(0.0, self._times[0] - after)  # the first step's warm-up
        held = last.realized >= policy.min_gain / 2
        return Verdict(
            False,
            f"check: {after:.3f} s a step, {last.before_s:.3f} s before the move: "
            f"{last.realized:.0%} faster, predicted {last.gain:.0%} "
            f"({'held' if held else 'did not hold'}); the move cost {last.cost_s:.2f} s",
        )

    def _settle(self, gain: float | None) -> None:
        self._settled = True
        self._settled_s = self._recent()
        if gain is not None:
            self._gains.append(gain)

    def _recent(self) -> float | None:
        """The median of the last ``window`` step times on this plan (its first left out)."""
        times = self._times[1:]
        return statistics.median(times[-self.policy.window :]) if times else None


def _changed(now: float, then: float, margin: float) -> bool:
    return now > then * (1 + margin) or now * (1 + margin) < then
