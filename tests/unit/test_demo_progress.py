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
    assert [line.split("|")[2].split()[0] for line in lines] == [
        "6/51",  # 5 steps in 10 s, 90 s left at that rate
        "11/51",
        "16/51",
        "21/51",
        "25/51",
    ]
    last = lines[-1]
    assert "[00:48<00:52,  2.00s/step, loss 2.500, 50 tokens/s]" in last, last


def test_max_steps_caps_the_expected_total_and_the_time_left() -> None:
    out = io.StringIO()
    run(out, duration_s=1000.0, max_steps=30, step_s=1.0, steps=30)
    lines = out.getvalue().splitlines()
    assert [line.split("|")[2].split()[0] for line in lines] == ["11/30", "21/30", "30/30"]
    assert "[00:10<00:19," in lines[0]


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
