"""A job's state and its database row: what is saved mid-replay, and what is read back."""

from __future__ import annotations

from pipesvc.coordinator.job_state import JobState
from pipesvc.core.config import JobConfig, config_from_dict
from pipesvc.core.plan import PipelineStage
from pipesvc.v1 import stage_pb2

LAYERS = [stage_pb2.LayerDescription(index=i, num_parameters=4) for i in range(3)]
PLAN = [
    PipelineStage(start_layer=0, end_layer=1, rank=0, address="127.0.0.1:1"),
    PipelineStage(start_layer=1, end_layer=3, rank=1, address="127.0.0.1:2"),
]


def _record(state: JobState) -> tuple[int, JobState]:
    record = state.to_record(
        job_id="job-1", config=JobConfig(model="mlp"), layers=LAYERS, plan=PLAN, epoch=4
    )
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
    return record.step, JobState.from_record(record)


def test_a_row_saved_mid_replay_counts_the_replay_target_as_committed() -> None:
    step, back = _record(JobState(step=3, run_id=9, checkpoint_step=2, replay_target=5))
    assert step == 5
    assert back == JobState(step=5, run_id=9, checkpoint_step=2)


def test_a_row_saved_between_steps_reads_back_the_same_counters() -> None:
    state = JobState(step=7, run_id=12, checkpoint_step=5)
    step, back = _record(state)
    assert step == 7
    assert back == state
    assert back.recoveries == 0 and back.gradients_valid and back.replay_target is None
