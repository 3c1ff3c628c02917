"""The identity a frame carries on an Exchange stream: job, plan epoch, run, micro-batch and
direction (``MicrobatchId``), and the mapping between wire and mailbox directions."""

from __future__ import annotations

from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, MailKey
from pipesvc.v1 import stage_pb2

DIRECTIONS = {stage_pb2.ACTIVATION: ACTIVATION, stage_pb2.GRADIENT: GRADIENT}
"""Wire direction to mailbox direction."""
_WIRE_DIRECTIONS = {v: k for k, v in DIRECTIONS.items()}


def opposite(direction: str) -> str:
    """The direction that answers ``direction`` on the same stream."""
    return GRADIENT if direction == ACTIVATION else ACTIVATION


def microbatch_id(
    job_id: str, epoch: int, direction: str, key: MailKey | None = None
) -> stage_pb2.MicrobatchId:
    """The identity of ``key``'s frames (run and micro-batch 0 for a control frame)."""
    return stage_pb2.MicrobatchId(
        job_id=job_id,
        plan_epoch=epoch,
        run_id=key.run_id if key else 0,
        microbatch_index=key.microbatch_index if key else 0,
        direction=_WIRE_DIRECTIONS[direction],
        part=key.part if key else 0,
    )
