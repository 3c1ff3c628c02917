"""A stage process freezes what it imported (see [Note: stage garbage collection])."""

from __future__ import annotations

import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_settling_freezes_the_imported_objects() -> None:
    """In a fresh process, as a stage: torch's and gRPC's objects leave the collected ones."""
    probe = (
        "import gc; from pipesvc.stage.server import settle_garbage_collector; "
        "before = len(gc.get_objects()); settle_garbage_collector(); "
        "print(before, gc.get_freeze_count(), len(gc.get_objects()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": _ROOT},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    before, frozen, tracked = (int(n) for n in out.split())
    assert frozen > before // 2  # most of what the imports made
    assert tracked < frozen // 10  # what collections still traverse
