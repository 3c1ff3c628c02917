"""The demo (the main job) on a short budget: it trains, checks step 1 and samples text."""

from __future__ import annotations

import io

from pipesvc.demo import DemoOptions, run_demo


def test_demo_loss_falls_and_step_one_matches_one_process() -> None:
    out = io.StringIO()
    summary = run_demo(
        DemoOptions(num_stages=2, duration_s=120, max_steps=60, batch_size=16), out=out
    )
    text = out.getvalue()
    assert summary["steps"] == 60
    # Starts near a uniform guess over the characters and clearly learns.
    assert abs(summary["start_loss"] - summary["uniform_loss"]) < 0.5
    assert summary["end_loss"] < summary["start_loss"] - 1.0
    assert summary["first_step_weight_diff"] < 1e-4
    assert "summary" in text and "sample through the pipeline" in text
    sample = text.split("sample through the pipeline:\n", 1)[1]
    assert sample.startswith("The ") and len(sample.strip()) > 100
