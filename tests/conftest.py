"""Every process a test starts runs this checkout's pipesvc (and can import ``tests.support``),
whichever copy of pipesvc the interpreter has installed, and from any working directory."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT)]
)
