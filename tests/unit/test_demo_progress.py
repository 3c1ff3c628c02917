"""The demo's progress: a live bar on a terminal, plain periodic lines anywhere else."""

from __future__ import annotations

import io
import re

from pipesvc.demo import LOG_EVERY_S, Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(out: io.StringIO, *, duration_s: float, max_steps: int, step_s: float, steps: int) -> None:
    progress = Progress(out, duration_s=duration_s, max_steps=max_steps, tokens_per_step=100)
    for step in range(2, steps + 1):
        progress.update(steps=step, elapsed=(step - 1) * step_s, loss=5.0 - step / 10)
    progress.close()


def test_away_from_a_terminal_it_prints_a_plain_line_every_interval_and_at_the_end() -> None:
    out = io.StringIO()
    # 2 s a step for 25 steps: 48 s, so lines at 10, 20, 30, 40 s and the last at 48 s.
    run(out, duration_s=100.0, max_steps=0, step_s=2.0, steps=25)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 48 // LOG_EVERY_S + 1
    assert [line.split(",")[0] for line in lines] == [
        "step 6",
        "step 11",
        "step 16",
        "step 21",
        "step 25",
    ]
    assert lines[-1] == "step 25, 00:48 of 01:40, 0.50 steps/s, loss 2.500, 50 tokens/s"


def test_in_a_log_each_line_shows_the_same_limits_while_the_rate_changes() -> None:
    # A log's reader compares lines: the totals in them are the fixed limits, not an estimate
    # that moved with every change of the step rate (6/51, then 12/34, ...).
    out = io.StringIO()
    progress = Progress(out, duration_s=60.0, max_steps=0, tokens_per_step=100)
    elapsed = 0.0
    for step in range(2, 41):
        elapsed += 0.5 if step < 20 else 2.0  # the rate drops halfway
        progress.update(steps=step, elapsed=elapsed, loss=1.0)
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3
    assert {line.split(", ")[1].split(" of ")[1] for line in lines} == {"01:00"}
    assert all("/" not in line.split(",")[0] for line in lines)  # no estimated total


def test_max_steps_is_the_total_each_line_shows() -> None:
    out = io.StringIO()
    run(out, duration_s=1000.0, max_steps=30, step_s=1.0, steps=30)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["step 11/30", "step 21/30", "step 30/30"]
    assert lines[0].startswith("step 11/30, 00:10 of 16:40, 1.00 steps/s")


def test_a_run_shorter_than_the_interval_still_ends_with_a_line() -> None:
    out = io.StringIO()
    run(out, duration_s=100.0, max_steps=4, step_s=0.1, steps=4)
    assert len(out.getvalue().splitlines()) == 1
    assert "4/4" in out.getvalue()


def test_on_a_terminal_it_is_a_live_bar_redrawn_in_place() -> None:
    out = Terminal()
    run(out, duration_s=100.0, max_steps=12, step_s=0.5, steps=12)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, redrawn with \r
    final = re.split(r"\r", text.rstrip("\n"))[-1]
    assert "12/12" in final and "step/s" in final and "tokens/s" in final and "loss" in final
