"""The README's Python example runs as written (docs that match the code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)  # job.save("ckpt") writes here
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # our own README, not input
    assert (tmp_path / "ckpt" / "manifest.json").exists()
    assert namespace["again"].step == 1  # type: ignore[attr-defined]
    assert len(namespace["again"].plan) == 2  # type: ignore[attr-defined]
