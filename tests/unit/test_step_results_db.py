"""The state database keeps a job's step results by request id with its row (see [Note: step
request ids] in pipesvc/coordinator/job.py): in one transaction, read back after a restart,
bounded to about the newest REMEMBERED_RESULTS, and gone once the job is closed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipesvc.coordinator.database import (
    REMEMBERED_RESULTS,
    TRIM_EVERY,
    JobRecord,
    StateDB,
    StepResult,
)


def _record(step: int, results: list[StepResult], *, closed: bool = False) -> JobRecord:
    return JobRecord(
        job_id="j",
        spec={},
        plan=[],
        layers=b"",
        epoch=1,
        step=step,
        run_id=step,
        checkpoint_step=-1,
        closed=closed,
        results=results,
    )


def _result(step: int) -> StepResult:
    return StepResult(request_id=f"r{step}", step=step, loss=step / 10, digest="d")


def test_results_survive_a_reopen_newest_kept(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    total = REMEMBERED_RESULTS + 2 * TRIM_EVERY
    for step in range(1, total + 1):
        db.put_job(_record(step, [_result(step)]))
    db.close()
    reopened = StateDB(tmp_path)
    (job,) = reopened.open_jobs()
    assert job.step == total
    kept = [r.step for r in job.results]
    assert REMEMBERED_RESULTS <= len(kept) < REMEMBERED_RESULTS + TRIM_EVERY
    assert kept == list(range(total - len(kept) + 1, total + 1))
    assert job.results[-1] == _result(total)
    reopened.put_job(_record(total, [], closed=True))
    assert reopened.open_jobs() == []
    assert reopened._results("j") == []
    reopened.close()


def test_a_failed_row_write_stores_no_result(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    db.put_job(_record(1, [_result(1)]))
    bad = _record(2, [_result(2)])
    bad.spec = {"unserialisable": object()}
    with pytest.raises(TypeError):
        db.put_job(bad)
    (job,) = db.open_jobs()
    assert (job.step, [r.step for r in job.results]) == (1, [1])
    db.put_job(_record(2, [_result(2)]))  # the failed transaction was rolled back
    (job,) = db.open_jobs()
    assert (job.step, [r.step for r in job.results]) == (2, [1, 2])
    db.close()


def test_counters_update_a_row_that_exists_and_keep_its_shape(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    first = _record(1, [_result(1)])
    first.spec, first.plan, first.layers = {"model": "mlp"}, [{"rank": 0}], b"described"
    db.put_job(first)
    later = _record(5, [_result(5)])  # spec, plan and layers empty: not written
    later.checkpoint_step = 3
    assert db.put_counters(later)
    (job,) = db.open_jobs()
    assert (job.spec, job.plan, job.layers) == ({"model": "mlp"}, [{"rank": 0}], b"described")
    assert (job.step, job.run_id, job.checkpoint_step) == (5, 5, 3)
    assert [r.step for r in job.results] == [1, 5]
    assert db.put_counters(_record(6, [], closed=True))
    assert db.open_jobs() == [] and db._results("j") == []
    db.close()


def test_counters_of_a_job_without_a_row_write_nothing(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    assert not db.put_counters(_record(4, [_result(4)]))
    assert db.open_jobs() == [] and db._results("j") == []
    db.put_job(_record(4, [_result(4)]))  # the transaction was closed either way
    (job,) = db.open_jobs()
    assert (job.step, [r.step for r in job.results]) == (4, [4])
    db.close()
