"""Asks a stage server directly what it holds (a test seam: the raw stage service)."""

from __future__ import annotations

import grpc
import torch

from pipesvc.core.tensor_codec import read_named_frames
from pipesvc.v1 import common_pb2, stage_pb2, stage_pb2_grpc


def stage_info(address: str) -> stage_pb2.StageInfo:
    with grpc.insecure_channel(address) as channel:
        return stage_pb2_grpc.StageServiceStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)


def stage_state(
    address: str, job_id: str, kind: common_pb2.StateKind.ValueType = common_pb2.CHECKPOINT
) -> dict[str, torch.Tensor]:
    """Every tensor of ``kind`` one stage holds for ``job_id`` (its own layers only)."""
    with grpc.insecure_channel(address) as channel:
        frames = stage_pb2_grpc.StageServiceStub(channel).GetState(
            stage_pb2.GetStateRequest(job_id=job_id, kind=kind), timeout=30
        )
        return dict(read_named_frames(frames))
