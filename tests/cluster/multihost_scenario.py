"""Runs inside the coordinator's network namespace: trains, takes a stage host's link down,
trains on, and checks the weights against one process. Prints a JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pipesvc
from pipesvc.security import Security
from pipesvc.transport import open_channel
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from tests.cluster.faults import Run


def _shm_flags(address: str, token: str) -> list[bool]:
    """Whether the stage sends through shared memory, downstream and upstream."""
    channel = open_channel(address, Security(token=token))
    try:
        info = stage_pb2_grpc.StageServiceStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)
    finally:
        channel.close()
    return [info.downstream_shm, info.upstream_shm]


def main(coordinator: str, token: str, down_netns: str, down_link: str) -> None:
    client = pipesvc.connect(coordinator, token=token, timeout_s=120)
    run = Run.start(client)
    plan_before = [s.address for s in run.job.plan]
    for _ in range(2):
        run.step()
    subprocess.run(["ip", "-n", down_netns, "link", "set", down_link, "down"], check=True)
    started = time.monotonic()
    run.step()
    recovered_s = time.monotonic() - started
    for _ in range(2):
        run.step()
    run.check_weights()
    job = run.job.refresh()
    shm = {s.address: _shm_flags(s.address, token) for s in job.plan}
    print(
        json.dumps(
            {
                "plan_before": plan_before,
                "plan_after": [s.address for s in job.plan],
                "recoveries": job.recoveries,
                "recovered_s": round(recovered_s, 2),
                "shm": shm,
                "step_s": [round(s, 3) for s in run.step_seconds],
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
