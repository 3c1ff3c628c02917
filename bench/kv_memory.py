"""What a stage's KV budget counts against what its sessions' caches really hold.

One stage (the built-in ``gpt``, 2 blocks, 64 wide, ``block_size`` 4096) runs, as the
coordinator's batcher runs them: a session with a ``--long`` (default 4000) token prompt, then
``--short`` (default 50) sessions with 10-token prompts, then ``--steps`` (default 2) decode steps
of all of them fused into one micro-batch; then the long session pauses and the others take
``--steps`` more steps without it. After each phase it prints the bytes the stage counts
(``SessionCaches.total_bytes``, what ``--kv-budget`` is checked against) and the bytes the
caches' tensors really keep alive (their storages, each once and whole), and their ratio.

Usage: ``python bench/kv_memory.py [--long 4000] [--short 50] [--steps 2]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pipesvc.coordinator.session import ModelSupport, Session, plan_step  # noqa: E402
from pipesvc.core.config import JobConfig  # noqa: E402
from pipesvc.core.sampling import Sampling  # noqa: E402
from pipesvc.stage.compute.engine import RunInputs, StepEngine  # noqa: E402
from pipesvc.stage.compute.recorder import RunRecorder  # noqa: E402
from pipesvc.stage.compute.runtime import StageRuntime  # noqa: E402
from pipesvc.stage.compute.sessions import SessionCaches  # noqa: E402
from pipesvc.stage.dataplane.mailbox import Mailbox  # noqa: E402

MIB = 2**20
ARGS = {"vocab_size": 64, "block_size": 4096, "embed_dim": 64, "num_heads": 4, "num_blocks": 2}


def held_bytes(caches: SessionCaches) -> int:
    """The bytes of every storage a session's cache tensor lives in, each once and whole."""
    storages: dict[tuple[str, int], int] = {}
    kept = [caches._stack.cache] if caches._stack is not None else []  # peeks, to measure
    for cache in list(caches._caches.values()) + kept:
        for keys, values in cache.tensors().values():
            for t in (keys, values):
                s = t.untyped_storage()
                storages[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def step(engine: StepEngine, sessions: list[Session], run_id: int) -> None:
    run = plan_step(sessions, 1, fuse=True)
    batch = run.batch
    result = engine.run_step(
        run_id,
        training=False,
        num_microbatches=len(batch.inputs),
        data=RunInputs(
            inputs=batch.inputs,
            targets=[],
            loss_weights=[],
            side=batch.side,
            caches=batch.caches,
            greedy=True,
        ),
        generating=True,
    )
    for session, logits in zip(sessions, run.logits(result.outputs), strict=True):
        session.advance(logits, 1)


def report(name: str, caches: SessionCaches) -> None:
    counted, held = caches.total_bytes(), held_bytes(caches)
    print(
        f"{name:<44} counted {counted / MIB:8.2f} MiB  held {held / MIB:8.2f} MiB  "
        f"held/counted {held / max(counted, 1):6.1f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=4000)
    parser.add_argument("--short", type=int, default=50)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = JobConfig(model="gpt", model_args=ARGS, num_stages=1, num_microbatches=1)
    runtime = StageRuntime(
        config=config,
        start_layer=0,
        end_layer=ARGS["num_blocks"] + 2,
        rank=0,
        num_stages=1,
        device=torch.device("cpu"),
    )
    features = runtime.features
    caches = SessionCaches(
        features.new_cache, budget_bytes=1 << 40, idle_s=3600.0, layout=features.cache_layout
    )

    def no_send(*_: Any) -> None:
        raise AssertionError("one stage sends nothing")

    engine = StepEngine(
        runtime=runtime,
        mailbox=Mailbox(),
        send_activation=no_send,
        send_gradient=no_send,
        recorder=RunRecorder(),
        recv_timeout_s=60.0,
        sessions=caches,
    )
    support = ModelSupport(
        kv_cache=True, side_inputs=features.side_inputs, fuses_caches=features.fuses_caches
    )
    g = torch.Generator().manual_seed(0)

    def session(length: int) -> Session:
        ids = torch.randint(0, ARGS["vocab_size"], (1, length), generator=g)
        return Session(ids, None, parts=1, sampling=Sampling(), support=support)

    long = session(args.long)
    short = [session(10) for _ in range(args.short)]
    run_id = 0
    with torch.no_grad():
        run_id += 1
        step(engine, [long], run_id)
        run_id += 1
        step(engine, short, run_id)
        report(f"prompts: 1 x {args.long} + {args.short} x 10", caches)
        for _ in range(args.steps):
            run_id += 1
            step(engine, [long, *short], run_id)
        report(f"after {args.steps} fused decode steps", caches)
        for _ in range(args.steps):
            run_id += 1
            step(engine, short, run_id)
        report(f"the long one paused, {args.steps} steps without it", caches)


if __name__ == "__main__":
    main()
