"""When a job measures and moves by itself (see [Note: settling] in core/settle.py).

A small simulated cluster drives the settler: each step's time is the bottleneck of the plan
the job is on (plus noise where a test asks), and each measurement predicts a gain (plus the
measurement's bias for that plan, as seen on a shared host).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pipesvc.core.settle import PROBE_STEPS, Policy, Settler

STAGES = ["a", "b", "c", "d"]


@dataclass
class Sim:
    """A job under a settler. ``step_s``: the step time of the plan it is on; a move takes it
    to ``moved_step_s`` (what the move really gives) and makes the measurement on the new plan
    predict ``gain_after`` (its bias: nothing really changed)."""

    settler: Settler
    step_s: float = 0.3
    gain: float = 0.3
    """What a measurement of the current plan predicts the best plan gains."""
    moved_step_s: float = 0.2
    gain_after: float = 0.3
    move_cost_s: float = 0.8
    noise: float = 0.0
    members: list[str] = field(default_factory=lambda: list(STAGES))
    epoch: int = 1
    moves: list[int] = field(default_factory=list)
    measured: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _first: bool = True

    def run(self, steps: int) -> None:
        for _ in range(steps):
            took = self.step_s * (1 + self.rng.uniform(-self.noise, self.noise))
            if self._first:
                took += 0.1  # a new plan's first step warms up
                self._first = False
            reason = self.settler.step(self.epoch, took, self.members)
            if reason is None:
                continue
            self.measured.append(reason)
            verdict = self.settler.decide(1.0, 1.0 - self.gain)
            self.verdicts.append(verdict.reason)
            if verdict.move:
                self.epoch += 1
                self.moves.append(len(self.measured))
                self.settler.moved(self.epoch, self.move_cost_s)
                self.step_s, self.gain = self.moved_step_s, self.gain_after
                self._first = True

    def recover(self) -> None:
        """Recovery put a plan in place (a stage was lost): a new epoch nothing here chose."""
        self.epoch += 1
        self._first = True


def _throughput(**policy: object) -> Settler:
    return Settler(Policy(probe=True, **policy))  # type: ignore[arg-type]


def test_the_probe_moves_once_and_a_stable_cluster_then_settles() -> None:
    """Measured after the probe steps, moved, checked; then 100 steps of the same step time
    ask for no measurement, even though every measurement of the new plan (biased) would
    predict another 30% gain."""
    sim = Sim(_throughput())
    sim.run(PROBE_STEPS)
    assert sim.measured == ["probe"] and len(sim.moves) == 1
    sim.run(100)
    assert sim.measured == ["probe", "check"], sim.verdicts
    assert "held" in sim.verdicts[1]
    assert len(sim.moves) == 1
    assert sim.settler.last_realized is not None and sim.settler.last_realized > 0.3


def test_a_stable_cluster_measured_periodically_does_not_move_again() -> None:
    """With ``rebalance``: measured every 20 steps, each measurement (biased) predicting 30-35%
    gain; none is clearly better than the one the plan settled with."""
    sim = Sim(_throughput(every=20))
    predicted = iter([0.35, 0.3, 0.33, 0.31, 0.34, 0.3, 0.35])
    sim.run(PROBE_STEPS + 10)
    assert len(sim.moves) == 1
    for _ in range(7):
        sim.gain = next(predicted)
        sim.run(20)
    assert sim.measured.count("periodic") == 7, sim.measured
    assert len(sim.moves) == 1, sim.verdicts


def test_noisy_step_times_within_the_margin_do_not_measure_or_move() -> None:
    """Step times jittering 20% either way never move the median of five past 30%."""
    sim = Sim(_throughput(), noise=0.2, gain=0.05)  # the probe finds nothing worth a move
    sim.run(300)
    assert sim.measured == ["probe"] and sim.moves == [], sim.verdicts


def test_noisy_predictions_within_the_margin_do_not_move() -> None:
    """Periodic measurements whose predicted gain wanders 4 points either way around the one
    the plan settled with."""
    sim = Sim(_throughput(every=20), gain=0.05)
    rng = random.Random(3)
    sim.run(PROBE_STEPS)
    for _ in range(20):
        sim.gain = 0.05 + rng.uniform(-0.04, 0.04)
        sim.run(20)
    assert sim.moves == [] and len(sim.measured) == 21, sim.verdicts


def test_a_clear_slowdown_moves() -> None:
    """Settled with nothing to gain; then a stage slows down: the step takes 60% longer, the
    job measures within a few steps, finds a plan 40% faster and moves."""
    sim = Sim(_throughput(), gain=0.02)
    sim.run(30)
    assert sim.measured == ["probe"] and sim.moves == []
    sim.step_s, sim.gain, sim.moved_step_s, sim.gain_after = 0.48, 0.4, 0.32, 0.02
    sim.run(10)
    assert sim.measured[1].startswith("step time") and sim.measured[2] == "confirm"
    assert len(sim.moves) == 1, sim.verdicts
    sim.run(100)
    assert len(sim.moves) == 1 and sim.measured[-1] == "check", sim.verdicts


def test_a_cluster_slowing_down_as_a_whole_measures_but_does_not_move() -> None:
    """Every stage 60% slower (a busy host): measured, and the plan found gains what it gained
    when the plan settled (a measurement's bias), so nothing moves."""
    sim = Sim(_throughput(), gain=0.2, moved_step_s=0.2, gain_after=0.25)
    sim.run(30)
    assert len(sim.moves) == 1
    sim.step_s = 0.32
    sim.run(30)
    assert sim.measured[-1].startswith("step time") and len(sim.moves) == 1, sim.verdicts


def test_a_move_that_did_not_pay_is_not_undone_or_followed_at_once() -> None:
    """A move predicted 30% faster ran no faster. The check's measurement predicts the way
    back (30%); later measurements predicting 30-45% (less than twice the margin over it)
    do not move the job back and forth."""
    sim = Sim(_throughput(every=10), moved_step_s=0.3, gain_after=0.3)
    sim.run(PROBE_STEPS + 6)
    assert len(sim.moves) == 1 and "did not hold" in sim.verdicts[1], sim.verdicts
    for gain in [0.3, 0.45, 0.35, 0.42, 0.3, 0.44, 0.38, 0.45, 0.3, 0.4]:
        sim.gain = gain
        sim.run(10)
    assert len(sim.moves) == 1, sim.verdicts


def test_after_a_move_that_did_not_pay_a_clearly_changed_cluster_still_moves() -> None:
    sim = Sim(_throughput(), moved_step_s=0.3, gain_after=0.1)
    sim.run(20)
    assert len(sim.moves) == 1 and "did not hold" in sim.verdicts[1]
    sim.step_s, sim.gain = 0.6, 0.45  # a stage slowed down: the way out is 35 points better
    sim.run(10)
    assert len(sim.moves) == 2, sim.verdicts


def test_a_move_that_cannot_pay_its_cost_back_is_not_taken() -> None:
    """The last move cost 20 s; saving 40% of a 0.3 s step pays 6 s back in 50 steps."""
    sim = Sim(_throughput(), move_cost_s=20.0, gain_after=0.0)
    sim.run(20)
    assert len(sim.moves) == 1
    sim.step_s, sim.gain = 0.3, 0.4  # slower than settled (0.2): measured
    sim.run(5)
    assert len(sim.moves) == 1 and "would not pay" in sim.verdicts[-1], sim.verdicts


def test_periodic_moves_wait_until_the_last_move_paid_for_itself() -> None:
    """The last move saved 0.03 s a step and cost 0.9 s (0.8 s and its first step's excess
    over the settled step): a clearly better plan found by a periodic measurement is taken
    (once confirmed) 30 steps after it at the earliest."""
    sim = Sim(_throughput(every=10), moved_step_s=0.27, gain_after=0.0)
    sim.run(PROBE_STEPS + 6)
    assert len(sim.moves) == 1 and sim.measured == ["probe", "check"]
    sim.gain = 0.3
    sim.run(14)  # periodic at 10 and 20 steps on the plan
    assert len(sim.moves) == 1 and "pays for itself after 30 steps" in sim.verdicts[-1]
    sim.run(10)  # clearly better at 30 steps, and confirmed 3 steps later
    assert len(sim.moves) == 1 and "to be confirmed" in sim.verdicts[-1], sim.verdicts
    sim.run(5)
    assert len(sim.moves) == 2 and sim.measured[-1] == "confirm", sim.verdicts


def test_a_stage_that_joins_is_measured_and_taken_if_it_helps() -> None:
    sim = Sim(_throughput(), gain=0.0)
    sim.run(20)
    assert sim.moves == []
    sim.members = [*STAGES, "e"]
    sim.gain = 0.3
    sim.run(1)
    assert sim.measured[-1] == "stages joined or left" and len(sim.moves) == 1


def test_a_plan_recovery_put_in_place_is_probed_afresh() -> None:
    """A lost stage: recovery re-plans; the new plan is probed and a move is taken even
    though the last one did not hold (that verdict was about another plan)."""
    sim = Sim(_throughput(), moved_step_s=0.3, gain_after=0.3)
    sim.run(20)
    assert len(sim.moves) == 1
    sim.recover()
    sim.run(PROBE_STEPS)
    assert sim.measured[-1] == "probe" and len(sim.moves) == 2, sim.verdicts


def test_a_replan_the_user_asked_for_is_checked_not_probed() -> None:
    settler = _throughput()
    settler.replanned(5)
    reasons = [settler.step(5, 0.2, STAGES) for _ in range(10)]
    assert reasons == [None] * 5 + ["check"] + [None] * 4
    assert not settler.decide(1.0, 0.9).move


def test_a_failed_check_settles_the_plan_anyway() -> None:
    settler = _throughput()
    settler.replanned(2)
    reasons = [settler.step(2, 0.2, STAGES) for _ in range(6)]
    assert reasons[-1] == "check"  # the measurement failed: decide is never called
    reasons = [settler.step(2, 0.4, STAGES) for _ in range(5)]
    assert reasons[-1] is not None and reasons[-1].startswith("step time"), reasons


def test_rebalance_without_probe_measures_first_at_its_period() -> None:
    settler = Settler(Policy(probe=False, every=20))
    reasons = [settler.step(1, 0.2, STAGES) for _ in range(20)]
    assert reasons == [None] * 19 + ["periodic"]
    assert settler.decide(1.0, 0.8).move


def test_one_measurement_clearly_better_is_confirmed_before_a_move() -> None:
    """A spike: one periodic measurement predicts 60% against the 10% the plan settled with;
    the measurement 3 steps later predicts 10% again, so nothing moves."""
    sim = Sim(_throughput(every=20), gain=0.1)
    sim.run(20)
    assert sim.measured == ["probe", "periodic"] and sim.moves == []
    sim.gain = 0.6
    sim.run(20)
    assert sim.measured[-1] == "periodic" and "to be confirmed" in sim.verdicts[-1]
    sim.gain = 0.1
    sim.run(5)
    assert sim.measured[-1] == "confirm" and sim.moves == [], sim.verdicts
    sim.run(100)
    assert sim.moves == []
