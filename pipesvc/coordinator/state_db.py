"""The coordinator's durable state in SQLite: jobs (spec, plan, counters) and stages.

A coordinator restarted on the same state directory reads its jobs back from here; stages
re-register on their own heartbeat. Every write commits before the call that caused it returns.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    spec_json TEXT NOT NULL,
    plan_json TEXT NOT NULL,
    layers BLOB NOT NULL,
    epoch INTEGER NOT NULL,
    step INTEGER NOT NULL,
    run_id INTEGER NOT NULL,
    checkpoint_step INTEGER NOT NULL,
    closed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS stages (
    address TEXT PRIMARY KEY,
    device TEXT NOT NULL,
    memory_bytes INTEGER NOT NULL,
    models_json TEXT NOT NULL
);
"""


@dataclass(kw_only=True)
class JobRecord:
    """One job's durable state."""

    job_id: str
    spec: dict[str, Any]
    """JobSpec fields as JSON (see config_to_proto)."""
    plan: list[dict[str, Any]]
    """PipelineStage fields, in rank order."""
    layers: bytes
    """The model description (a serialized DescribeResponse)."""
    epoch: int
    step: int
    """Committed steps."""
    run_id: int
    """Highest run id used."""
    checkpoint_step: int
    """Step of the newest checkpoint, or -1 when the job's initial weights are its seed's."""
    closed: bool = False


class StateDB:
    """A thread-safe handle on ``state.sqlite3`` in the coordinator's state directory."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "state.sqlite3"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a committed write survives the process being killed (what recovery
        # needs); only a power loss can drop the newest few.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def put_job(self, record: JobRecord) -> None:
        """Inserts or replaces a job's record."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.job_id,
                    json.dumps(record.spec, sort_keys=True),
                    json.dumps(record.plan),
                    record.layers,
                    record.epoch,
                    record.step,
                    record.run_id,
                    record.checkpoint_step,
                    int(record.closed),
                ),
            )

    def open_jobs(self) -> list[JobRecord]:
        """Every job not closed."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE closed = 0").fetchall()
        return [
            JobRecord(
                job_id=row[0],
                spec=json.loads(row[1]),
                plan=json.loads(row[2]),
                layers=bytes(row[3]),
                epoch=row[4],
                step=row[5],
                run_id=row[6],
                checkpoint_step=row[7],
                closed=bool(row[8]),
            )
            for row in rows
        ]

    def put_stage(self, address: str, device: str, memory_bytes: int, models: list[str]) -> None:
        """Records a stage registration."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO stages VALUES (?, ?, ?, ?)",
                (address, device, memory_bytes, json.dumps(models)),
            )

    def forget_stages(self, addresses: list[str]) -> None:
        """Deletes the stages' records (see [Note: forgetting stages] in registry.py)."""
        with self._lock:
            self._db.executemany("DELETE FROM stages WHERE address = ?", [(a,) for a in addresses])

    def stages(self) -> list[tuple[str, str, int, list[str]]]:
        """Every stage registered and not forgotten: (address, device, memory_bytes, models)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM stages").fetchall()
        return [(r[0], r[1], int(r[2]), json.loads(r[3])) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
