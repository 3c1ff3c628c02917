"""The README's Python example runs as written (docs that match the code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)  # job.save("ckpt") writes here
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # our own README, not input
    assert (tmp_path / "ckpt" / "manifest.json").exists()
    assert namespace["again"].step == 11  # type: ignore[attr-defined]
    assert len(namespace["again"].plan) == 2  # type: ignore[attr-defined]
    # It shows that it worked: the job, the step's loss, the step after ``job.train``'s ten,
    # the output and the resumed job.
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6, lines
    assert re.fullmatch(
        r"Job\(id='\w+', model='mlp', step=0, .*plan=\[\[0, \d+\) at .*\], recoveries=0\)", lines[0]
    )
    assert re.fullmatch(r"step 1: loss \d+\.\d{4}", lines[1]), lines[1]
    assert lines[2:] == ["step 11", "outputs (4, 8)", "resumed at step 11 on 2 stages", "True"]


def test_every_test_file_the_docs_name_exists() -> None:
    root = README.parent
    docs = [README, *sorted((root / "docs").glob("*.md"))]
    named = {
        (doc.name, path)
        for doc in docs
        for path in re.findall(r"tests/[\w/]+\.py", doc.read_text(encoding="utf-8"))
    }
    assert named, "the docs name no test files"
    missing = sorted((doc, path) for doc, path in named if not (root / path).is_file())
    assert missing == []


def test_readme_hugging_face_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    example = [b for b in blocks if b.startswith("# Bring a Hugging Face model")]
    assert len(example) == 1, "README has no Hugging Face example"
    monkeypatch.chdir(tmp_path)  # the model directory is written here
    exec(compile(example[0], "README.md", "exec"), {})  # our own README, not input
    assert (tmp_path / "tiny-llama" / "config.json").exists()
    assert (tmp_path / "tiny-llama-lora" / "adapter_config.json").exists()
    line, generated = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"loss \d+\.\d{4}, logits \(4, 32, 256\)", line), line
    # Two rows of 8 new token ids.
    assert re.fullmatch(r"generated \[\[(\d+, ){7}\d+\], \[(\d+, ){7}\d+\]\]", generated)
