"""Runs inside the coordinator's network namespace. ``wait COORDINATOR TOKEN COUNT``: waits
until COUNT stages are registered and serving, then prints their addresses in registration
order as JSON. ``replicas COORDINATOR TOKEN``: trains a job of 2 replicas x 2 stages (one stage
per host) against one process on the whole batch; prints a JSON summary. Otherwise: trains,
takes a stage host's link down, trains on, and checks the weights against one process; prints
a JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pipesvc
from pipesvc.errors import PipesvcError
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from pipesvc.wire.security import Security
from pipesvc.wire.transport import open_channel
from tests.support.faults import Run
from tests.support.reference import PROBLEMS, Reference


def _shm_flags(address: str, token: str) -> list[bool]:
    """Whether the stage sends through shared memory, downstream and upstream."""
    channel = open_channel(address, Security(token=token))
    try:
        info = stage_pb2_grpc.StageServiceStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)
    finally:
        channel.close()
    return [info.downstream_shm, info.upstream_shm]


def wait_for_stages(coordinator: str, token: str, count: int, timeout_s: float = 120.0) -> None:
    """Polls the coordinator (it may not be up yet) until ``count`` stages are serving, as a
    user's script must before creating a job on stages that are still starting."""
    deadline = time.monotonic() + timeout_s
    with pipesvc.connect(coordinator, token=token, timeout_s=5) as client:
        while time.monotonic() < deadline:
            try:
                stages = client.stages()
            except PipesvcError:
                stages = []
            serving = [s.address for s in stages if s.health == "SERVING"]
            if len(serving) >= count:
                print(json.dumps(serving))
                return
            time.sleep(0.2)
    sys.exit(f"timed out after {timeout_s} s waiting for {count} stages to register")


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


def replicas(coordinator: str, token: str) -> None:
    client = pipesvc.connect(coordinator, token=token, timeout_s=120)
    problem = PROBLEMS["gpt"]
    optimizer = {"name": "adamw", "lr": 1e-2}
    reference = Reference(problem, seed=4, optimizer=optimizer, clip_grad_norm=1.0)
    job = client.create_job(
        model=problem.model,
        model_args=problem.model_args,
        seed=4,
        num_stages=2,
        data_parallel=2,
        num_microbatches=2,
        optimizer=optimizer,
        loss=problem.loss,
        clip_grad_norm=1.0,
    )
    losses = []
    for step in range(4):
        x, y = problem.batch(9, seed=step)
        losses.append((job.train_step(x, y), reference.step(x, y)))
    weights = job.state_dict()
    worst = max(
        float((weights[key] - value).abs().max())
        for key, value in reference.model.state_dict().items()
    )
    print(
        json.dumps(
            {
                "plan": [[s.replica, s.rank, s.address] for s in job.plan],
                "losses": losses,
                "max_weight_error": worst,
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "wait":
        wait_for_stages(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "replicas":
        replicas(sys.argv[2], sys.argv[3])
    else:
        main(*sys.argv[1:5])
