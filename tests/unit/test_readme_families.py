"""The README's table of tested Hugging Face families is the test table's, not a second copy."""

from __future__ import annotations

from pathlib import Path

from tests.support.hf_families import markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_lists_the_families_the_tests_check() -> None:
    text = README.read_text(encoding="utf-8")
    start, end = "<!-- tested families: start -->\n", "<!-- tested families: end -->"
    assert start in text and end in text
    listed = text.split(start, 1)[1].split(end, 1)[0]
    assert listed == markdown(), "regenerate with: python -m tests.support.hf_families"
