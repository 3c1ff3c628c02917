"""Asks a stage server directly what it holds (a test seam: the raw stage service)."""

from __future__ import annotations

import grpc

from pipesvc.v1 import stage_pb2, stage_pb2_grpc


def stage_info(address: str) -> stage_pb2.StageInfo:
    with grpc.insecure_channel(address) as channel:
        return stage_pb2_grpc.StageServiceStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)
