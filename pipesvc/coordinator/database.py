"""The coordinator's durable state in SQLite: jobs (spec, plan, counters, the results of their
newest steps by request id) and stages.

A coordinator restarted on the same state directory reads its jobs back from here; stages
re-register on their own heartbeat. Every write commits before the call that caused it returns.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
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
    results: list[StepResult] = field(default_factory=list)
    """Results of training steps by request id (see [Note: step request ids] in
    step_request.py), oldest first: ``put_job`` stores these beside the row (those stored
    already are kept as they are); ``open_jobs`` reads back every one the job remembers."""


MAX_STEP = 2**63 - 1
"""The largest step an SQLite INTEGER holds."""
REMEMBERED_RESULTS = 1024
"""Step results a job keeps by request id; older ones are forgotten (a retry comes soon)."""
TRIM_EVERY = 64
"""The database forgets a job's older step results once per this many writes of them."""
RESULTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_results (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    loss REAL NOT NULL,
    digest TEXT NOT NULL,
    UNIQUE (job_id, request_id)
);
CREATE INDEX IF NOT EXISTS step_results_order ON step_results (job_id, seq);
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """The reply a training step got, remembered under the client's id for it."""

    request_id: str
    step: int
    loss: float
    digest: str
    """SHA-256 of the request's batch, so that an id reused for another batch is refused."""


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
        self._db.executescript(RESULTS_SCHEMA)
        self._result_writes: dict[str, int] = {}

    def put_job(self, record: JobRecord) -> None:
        """Inserts or replaces a job's record, with its new step results, in one transaction
        (a step counts as decided in the database together with its result)."""
        with self._transaction():
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
            self._put_results_or_close(record)

    def put_counters(self, record: JobRecord) -> bool:
        """Writes the counters of a job's row that exists (step, run id, checkpoint step,
        closed), with its new step results, in one transaction, leaving its spec, plan, layers
        and epoch as stored; False, with nothing written, when the job has no row.

        For a caller that knows those four are what the row holds (see [Note: the row's
        counters] in ledger.py): the step path writes a few integers, not the whole row.
        """
        with self._transaction():
            updated = self._db.execute(
                "UPDATE jobs SET step = ?, run_id = ?, checkpoint_step = ?, closed = ? "
                "WHERE job_id = ?",
                (
                    record.step,
                    record.run_id,
                    record.checkpoint_step,
                    int(record.closed),
                    record.job_id,
                ),
            ).rowcount
            if updated:
                self._put_results_or_close(record)
        return bool(updated)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction under the handle's lock: committed if the block returns,
        rolled back if it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # a failed COMMIT may have rolled back already
                    self._db.execute("ROLLBACK")
                raise

    def _put_results_or_close(self, record: JobRecord) -> None:
        if record.closed:  # a closed job takes no more steps
            self._db.execute("DELETE FROM step_results WHERE job_id = ?", (record.job_id,))
        else:
            self._put_results(record.job_id, record.results)

    def _put_results(self, job_id: str, results: Sequence[StepResult]) -> None:
        if not results:
            return
        self._db.executemany(
            "INSERT OR IGNORE INTO step_results (job_id, request_id, step, loss, digest) "
            "VALUES (?, ?, ?, ?, ?)",
            [(job_id, r.request_id, r.step, r.loss, r.digest) for r in results],
        )
        # Forgets what is past the newest REMEMBERED_RESULTS (on the index: no table scan),
        # every TRIM_EVERY writes of a job's results (a job keeps up to TRIM_EVERY - 1 more).
        writes = self._result_writes.get(job_id, 0)
        self._result_writes[job_id] = writes + 1
        if writes % TRIM_EVERY:
            return
        self._db.execute(
            "DELETE FROM step_results WHERE job_id = ? AND seq <= (SELECT seq FROM step_results "
            "WHERE job_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
            (job_id, job_id, REMEMBERED_RESULTS),
        )

    def _results(self, job_id: str) -> list[StepResult]:
        rows = self._db.execute(
            "SELECT request_id, step, loss, digest FROM step_results WHERE job_id = ? ORDER BY seq",
            (job_id,),
        ).fetchall()
        return [StepResult(request_id=r[0], step=r[1], loss=r[2], digest=r[3]) for r in rows]

    def open_jobs(self) -> list[JobRecord]:
        """Every job not closed."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE closed = 0").fetchall()
            results = {row[0]: self._results(row[0]) for row in rows}
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
                results=results[row[0]],
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
