"""The demo (the main job) on a short budget: it trains, checks step 1 and samples text."""

from __future__ import annotations

import io
from pathlib import Path

from pipesvc.demo import DemoOptions, run_demo


def test_demo_loss_falls_and_step_one_matches_one_process(tmp_path: Path) -> None:
    out = io.StringIO()
    stem = tmp_path / "trace"
    summary = run_demo(
        DemoOptions(
            num_stages=2, duration_s=120, max_steps=60, batch_size=16, trace_path=str(stem)
        ),
        out=out,
    )
    assert stem.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "traceEvents" in stem.with_suffix(".json").read_text()
    assert "bubble" in out.getvalue()
    # The idle shares say what they measure, and what the ideal beside them is.
    assert "idle: the share of each step's window" in out.getvalue()
    assert "ideal: the schedule's own bubble" in out.getvalue()
    text = out.getvalue()
    assert summary["steps"] == 60
    # Starts near a uniform guess over the characters and clearly learns.
    assert abs(summary["start_loss"] - summary["uniform_loss"]) < 0.5
    assert summary["end_loss"] < summary["start_loss"] - 1.0
    assert summary["first_step_weight_diff"] < 1e-4
    assert "summary" in text and "sample through the pipeline" in text
    sample = text.split("sample through the pipeline:\n", 1)[1]
    assert sample.startswith("The ") and len(sample.strip()) > 100
