"""The step ledger (see [Note: step ledger]): each transition in the order it is legal in, each
refused out of order with nothing changed, its row, and that nothing else writes its state."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipesvc.coordinator.database import StateDB, StepResult
from pipesvc.coordinator.job_counters import JobState, PendingCommit
from pipesvc.coordinator.ledger import Ledger, TransitionError
from pipesvc.core.config import JobConfig, config_from_dict, config_to_dict
from pipesvc.core.plan import PipelineStage
from pipesvc.errors import StageUnavailableError
from pipesvc.v1 import stage_pb2

ROOT = Path(__file__).resolve().parents[2]
COORDINATOR = ROOT / "pipesvc" / "coordinator"
GUARDED = (
    "step",
    "pending",
    "run_id",
    "replay_target",
    "gradients_valid",
    "checkpoint_step",
    "decided_at",
    "run_ahead",
)
"""The ledger's state: only ``ledger.py`` assigns these (or their private ``_`` names)."""
NOT_THE_LEDGERS = {("state_io.py", "request.step")}
"""Assignments of those names in the coordinator that are not the job's state (a proto
field)."""

LAYERS = [stage_pb2.LayerDescription(index=i, num_parameters=4) for i in range(3)]
PLAN = [
    PipelineStage(start_layer=0, end_layer=1, rank=0, address="127.0.0.1:1"),
    PipelineStage(start_layer=1, end_layer=3, rank=1, address="127.0.0.1:2"),
]


@dataclasses.dataclass
class Shape:
    job_id: str = "job-1"
    config: JobConfig = dataclasses.field(default_factory=lambda: JobConfig(model="mlp"))
    layers: list[stage_pb2.LayerDescription] = dataclasses.field(default_factory=lambda: LAYERS)
    plan: list[PipelineStage] = dataclasses.field(default_factory=lambda: PLAN)
    epoch: int = 4


class Committer:
    """Records each commit sent; fails the next ones while ``failing``."""

    def __init__(self) -> None:
        self.sent: list[tuple[PendingCommit, bool]] = []
        self.failing = False

    def commit(self, pending: PendingCommit, *, after_failed_run: bool) -> None:
        self.sent.append((pending, after_failed_run))
        if self.failing:
            raise StageUnavailableError(f"the commit of step {pending.step} failed")


@pytest.fixture
def db(tmp_path: Path) -> Iterator[StateDB]:
    db = StateDB(tmp_path)
    yield db
    db.close()


def make(db: StateDB, **counters: int) -> tuple[Ledger, Committer]:
    committer = Committer()
    ledger = Ledger(shape=Shape(), state=JobState(), db=db, committer=committer, **counters)
    return ledger, committer


def decide(ledger: Ledger, grad_scale: float | None = None) -> PendingCommit:
    """A run phase that succeeded, decided."""
    return ledger.decided(ledger.begin_run(), grad_scale)


def seen(ledger: Ledger) -> tuple[object, ...]:
    """Everything the ledger holds."""
    return (
        ledger.step,
        ledger.pending,
        ledger.run_id,
        ledger.replay_target,
        ledger.gradients_valid,
        ledger.checkpoint_step,
        ledger.decided_at,
    )


# -- legal orders ------------------------------------------------------------------------------


def test_a_decided_step_counts_and_its_commit_is_pending_until_a_run_carries_it(
    db: StateDB,
) -> None:
    ledger, committer = make(db)
    pending = decide(ledger, 0.5)
    assert (ledger.step, ledger.run_id) == (1, 1)
    assert pending == PendingCommit(step=1, run_id=1, grad_scale=0.5)
    assert ledger.pending == pending and ledger.decided_at > 0
    ledger.begin_run()  # the next run carries it
    ledger.carried(pending)
    assert ledger.pending is None and ledger.gradients_valid
    assert decide(ledger).step == 2
    assert committer.sent == []


def test_a_run_sent_ahead_is_decided_after_the_run_it_follows_and_then_taken(
    db: StateDB,
) -> None:
    """See [Note: steps ahead]: the next step's run is begun while the running one is out;
    the running one is still the one decided, and the one sent ahead carries its commit."""
    ledger, committer = make(db)
    first = ledger.begin_run()
    second = ledger.begin_ahead(first)
    assert (ledger.run_id, ledger.run_ahead) == (second, (second, first))
    pending = ledger.decided(first, None)
    assert pending == PendingCommit(step=1, run_id=first, grad_scale=None)
    ledger.ahead_taken(second)
    assert ledger.run_ahead is None
    ledger.carried(pending)
    assert ledger.decided(second, None).step == 2
    assert committer.sent == []


def test_a_run_that_failed_after_a_stage_went_past_it_rebuilds_to_the_decided_step(
    db: StateDB,
) -> None:
    ledger, _ = make(db)
    first = decide(ledger)
    running = ledger.begin_run()
    ledger.carried(first)
    ledger.begin_ahead(running)
    ledger.diverged()
    assert (ledger.step, ledger.pending, ledger.run_ahead, ledger.replay_target) == (
        1,
        None,
        None,
        1,
    )
    assert ledger.rebuilding() == 1


def test_a_rebuild_drops_the_run_sent_ahead(db: StateDB) -> None:
    ledger, _ = make(db)
    ledger.begin_ahead(ledger.begin_run())
    ledger.rebuilding()
    assert ledger.run_ahead is None


def test_a_step_due_a_checkpoint_asks_the_carrying_run_for_a_snapshot(db: StateDB) -> None:
    ledger, _ = make(db)
    decide(ledger)
    ledger.snapshot_due()
    pending = ledger.pending
    assert pending is not None and pending.snapshot
    ledger.carried(pending)
    assert ledger.pending is None


def test_a_flush_sends_the_explicit_commit_once(db: StateDB) -> None:
    ledger, committer = make(db)
    assert ledger.flush() is None and committer.sent == []
    pending = decide(ledger)
    assert ledger.flush() == pending
    assert committer.sent == [(pending, False)]
    assert ledger.pending is None and ledger.replay_target is None
    assert ledger.flush() is None and len(committer.sent) == 1


def test_a_commit_that_fails_makes_its_step_the_replay_target(db: StateDB) -> None:
    ledger, committer = make(db)
    decide(ledger)
    committer.failing = True
    with pytest.raises(StageUnavailableError):
        ledger.flush()
    assert ledger.pending is None and ledger.replay_target == 1
    assert ledger.committed_step == 1


def test_a_carrying_run_that_failed_settles_its_commit_and_reports_no_gradients(
    db: StateDB,
) -> None:
    ledger, committer = make(db)
    pending = decide(ledger)
    ledger.begin_run()
    ledger.aborted(training=True)
    assert not ledger.gradients_valid and ledger.pending == pending
    ledger.settle(pending, after_failed_run=True)
    assert committer.sent == [(pending, True)]
    assert ledger.pending is None and not ledger.gradients_valid  # until the next commit
    decide(ledger)
    ledger.flush()
    assert ledger.gradients_valid


def test_an_aborted_inference_run_leaves_the_gradients(db: StateDB) -> None:
    ledger, _ = make(db)
    ledger.begin_run()
    ledger.aborted(training=False)
    assert ledger.gradients_valid


def test_a_carrying_run_that_lost_a_stage_leaves_the_step_to_a_rebuild(db: StateDB) -> None:
    ledger, committer = make(db, step=4, run_id=10)
    pending = decide(ledger)
    ledger.begin_run()
    ledger.lost(pending)
    assert ledger.pending is None and ledger.replay_target == 5
    assert committer.sent == []


def test_a_rebuild_restores_replays_and_reaches_its_target(db: StateDB) -> None:
    ledger, _ = make(db, step=6, run_id=20, checkpoint_step=3)
    decide(ledger)  # step 7, pending
    target = ledger.rebuilding()
    assert target == 7 and ledger.pending is None and ledger.replay_target == 7
    ledger.restored(3)
    assert ledger.step == 3 and ledger.committed_step == 7
    for _ in range(4):
        pending = ledger.pending
        run_id = ledger.begin_run()
        if pending is not None:
            ledger.carried(pending)
        ledger.decided(run_id, None)
    assert ledger.step == 7
    ledger.replayed()
    assert ledger.replay_target is None and ledger.pending is not None


def test_a_rebuild_interrupted_mid_replay_keeps_its_target(db: StateDB) -> None:
    ledger, _ = make(db, step=5, checkpoint_step=2)
    assert ledger.rebuilding() == 5
    ledger.restored(2)
    decide(ledger)  # replayed step 3; then the replay failed
    assert ledger.rebuilding() == 5
    ledger.restored(2)
    assert ledger.committed_step == 5


def test_a_durable_checkpoint_and_a_load_and_its_undoing(db: StateDB) -> None:
    ledger, _ = make(db, step=8, checkpoint_step=4)
    ledger.checkpointed(8)
    assert ledger.checkpoint_step == 8
    before = ledger.loaded(3)
    assert ledger.step == 3
    ledger.unloaded(before)
    assert (ledger.step, ledger.checkpoint_step, ledger.replay_target) == (8, 8, 8)


def test_a_restarted_coordinator_adopts_the_stages_newest_run(db: StateDB) -> None:
    ledger, _ = make(db, run_id=7)
    ledger.adopt_runs([3, 12, 9])
    assert ledger.begin_run() == 13
    ledger.adopt_runs([])
    assert ledger.run_id == 13


# -- illegal orders ----------------------------------------------------------------------------

Setup = Callable[[Ledger], object]
Illegal = Callable[[Ledger], object]


def _pending(ledger: Ledger) -> PendingCommit:
    assert ledger.pending is not None
    return ledger.pending


OTHER = PendingCommit(step=1, run_id=99, grad_scale=None)

ILLEGAL: dict[str, tuple[Setup, Illegal]] = {
    "decided with a commit pending": (decide, lambda led: led.decided(led.begin_run(), None)),
    "decided for a stale run": (lambda led: led.begin_run(), lambda led: led.decided(0, None)),
    "decided past the replay target": (
        lambda led: rebuilt(led, decide(led).step),
        lambda led: led.decided(led.begin_run(), None),
    ),
    "a snapshot with no commit pending": (lambda led: None, lambda led: led.snapshot_due()),
    "carried with no commit pending": (lambda led: None, lambda led: led.carried(OTHER)),
    "carried, another commit": (decide, lambda led: led.carried(OTHER)),
    "lost with no commit pending": (lambda led: None, lambda led: led.lost(OTHER)),
    "lost, another commit": (decide, lambda led: led.lost(OTHER)),
    "settled with no commit pending": (
        lambda led: None,
        lambda led: led.settle(OTHER, after_failed_run=True),
    ),
    "sent ahead of a stale run": (
        lambda led: led.begin_run(),
        lambda led: led.begin_ahead(led.run_id - 1),
    ),
    "sent ahead twice": (
        lambda led: led.begin_ahead(led.begin_run()),
        lambda led: led.begin_ahead(led.run_id),
    ),
    "decided, the run sent ahead": (
        lambda led: led.begin_ahead(led.begin_run()),
        lambda led: led.decided(led.run_id - 2, None),
    ),
    "taken before the run it follows was decided": (
        lambda led: led.begin_ahead(led.begin_run()),
        lambda led: led.ahead_taken(led.run_id),
    ),
    "taken, another run": (
        lambda led: (led.begin_ahead(led.begin_run()), led.decided(led.run_id - 1, None)),
        lambda led: led.ahead_taken(led.run_id + 1),
    ),
    "restored outside a rebuild": (lambda led: None, lambda led: led.restored(0)),
    "restored past the rebuild's target": (
        lambda led: led.rebuilding(),
        lambda led: led.restored(led.step + 1),
    ),
    "replayed short of the target": (
        lambda led: (decide(led), decide_after(led), rebuilt(led, 0)),
        lambda led: led.replayed(),
    ),
    "replayed outside a rebuild": (lambda led: None, lambda led: led.replayed()),
    "a checkpoint past the committed steps": (decide, lambda led: led.checkpointed(2)),
    "loaded with a commit pending": (decide, lambda led: led.loaded(0)),
    "loaded during a rebuild": (lambda led: led.rebuilding(), lambda led: led.loaded(0)),
}


def rebuilt(ledger: Ledger, step: int) -> int:
    """A rebuild under way, restored at ``step``; returns its target."""
    target = ledger.rebuilding()
    ledger.restored(step)
    return target


def decide_after(ledger: Ledger) -> PendingCommit:
    """The next step decided, its predecessor's commit carried by its run."""
    pending = _pending(ledger)
    run_id = ledger.begin_run()
    ledger.carried(pending)
    return ledger.decided(run_id, None)


@pytest.mark.parametrize("case", list(ILLEGAL))
def test_a_transition_out_of_order_raises_and_changes_nothing(db: StateDB, case: str) -> None:
    setup, illegal = ILLEGAL[case]
    ledger, committer = make(db)
    setup(ledger)
    before, sent = seen(ledger), list(committer.sent)
    with pytest.raises(TransitionError) as raised:
        illegal(ledger)
    assert isinstance(raised.value, AssertionError)  # a bug, never taken for a stage fault
    # begin_run (in some of the calls) is legal on its own; the rest is untouched.
    after = seen(ledger)
    assert after[:2] == before[:2] and after[3:] == before[3:], case
    assert committer.sent == sent


def test_its_state_is_read_only_from_outside(db: StateDB) -> None:
    ledger, _ = make(db)
    for name in GUARDED:
        with pytest.raises(AttributeError):
            setattr(ledger, name, 1)
    assert not {f.name for f in dataclasses.fields(JobState)} & set(GUARDED)


# -- the row -----------------------------------------------------------------------------------


def test_a_row_saved_mid_replay_counts_the_replay_target_as_committed(db: StateDB) -> None:
    ledger, _ = make(db, step=5, run_id=9, checkpoint_step=2)
    ledger.rebuilding()
    ledger.restored(2)
    decide(ledger)
    record = ledger.record()
    assert (record.step, record.run_id, record.checkpoint_step) == (5, 10, 2)
    assert config_from_dict(record.spec) == JobConfig(model="mlp")
    assert record.plan[1] == {
        "start_layer": 1,
        "end_layer": 3,
        "rank": 1,
        "address": "127.0.0.1:2",
        "replica": 0,
        "chunk": 0,
    }
    assert list(stage_pb2.DescribeResponse.FromString(record.layers).layers) == LAYERS
    assert record.epoch == 4


def test_a_row_persisted_reads_back_the_same_counters_and_results(db: StateDB) -> None:
    ledger, _ = make(db, step=7, run_id=12, checkpoint_step=5)
    result = StepResult(request_id="r", step=7, loss=0.25, digest="d")
    ledger.state.remember(result)
    ledger.persist()
    assert ledger.state.unsaved == []
    (record,) = db.open_jobs()
    assert (record.step, record.run_id, record.checkpoint_step) == (7, 12, 5)
    back = JobState.from_record(record)
    assert back.results == {"r": result} and not back.closed and back.recoveries == 0


def _stored_shape(db: StateDB) -> tuple[str, str, bytes, int]:
    with db._lock:
        row = db._db.execute("SELECT spec_json, plan_json, layers, epoch FROM jobs").fetchone()
    return row[0], row[1], bytes(row[2]), row[3]


def _scribble(db: StateDB) -> None:
    """Overwrites the stored shape, so a row written whole again shows."""
    with db._lock:
        db._db.execute(
            "UPDATE jobs SET spec_json = '{}', plan_json = '[]', layers = x'', epoch = 0"
        )


@pytest.mark.parametrize("change", ["plan", "config", "layers", "epoch", "row gone"])
def test_a_step_writes_the_counters_and_a_changed_shape_the_whole_row(
    db: StateDB, change: str
) -> None:
    shape = Shape()
    ledger = Ledger(shape=shape, state=JobState(), db=db, committer=Committer())
    ledger.persist()
    whole = _stored_shape(db)
    _scribble(db)
    decide(ledger)
    ledger.persist()  # the same shape: the counters only
    assert _stored_shape(db) == ("{}", "[]", b"", 0)
    (record,) = db.open_jobs()
    assert (record.step, record.run_id) == (1, 1)
    if change == "plan":
        shape.plan = [PLAN[0], dataclasses.replace(PLAN[1], address="127.0.0.1:3")]
    elif change == "config":
        shape.config = dataclasses.replace(shape.config, checkpoint_every=7)
    elif change == "layers":
        shape.layers = [*LAYERS, stage_pb2.LayerDescription(index=3, num_parameters=1)]
    elif change == "epoch":
        shape.epoch += 1
    else:
        with db._lock:
            db._db.execute("DELETE FROM jobs")
    ledger.flush()
    decide(ledger)
    ledger.persist()
    (record,) = db.open_jobs()
    assert (record.step, record.run_id) == (2, 2)
    assert record.spec == config_to_dict(shape.config)
    assert record.plan == [stage.to_dict() for stage in shape.plan]
    assert list(stage_pb2.DescribeResponse.FromString(record.layers).layers) == shape.layers
    assert record.epoch == shape.epoch
    if change == "row gone":
        assert _stored_shape(db) == whole
    else:
        assert _stored_shape(db) != whole


# -- one writer --------------------------------------------------------------------------------


def _assignments(tree: ast.AST) -> Iterator[ast.Attribute]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets: list[ast.expr] = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            yield from (t for t in ast.walk(target) if isinstance(t, ast.Attribute))


def test_nothing_outside_the_ledger_assigns_its_state() -> None:
    found = []
    for path in sorted(COORDINATOR.glob("*.py")):
        if path.name == "ledger.py":
            continue
        tree = ast.parse(path.read_text())
        for target in _assignments(tree):
            what = ast.unparse(target)
            if target.attr.lstrip("_") in GUARDED and (path.name, what) not in NOT_THE_LEDGERS:
                found.append(f"{path.name}:{target.lineno}: {what}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name | ast.Attribute)
                and ast.unparse(node.func).endswith("setattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).lstrip("_") in GUARDED
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_writer_check_finds_a_stray_write() -> None:
    tree = ast.parse("ledger._step = 3\nstate.pending = None\nx.replay_target += 1\n")
    assert [ast.unparse(t) for t in _assignments(tree)] == [
        "ledger._step",
        "state.pending",
        "x.replay_target",
    ]
