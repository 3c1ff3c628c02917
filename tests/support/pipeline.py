"""P step engines of one job in one process, wired by in-process sends, driven as the
coordinator drives them: each engine has a real StageRuntime for its layers and a Mailbox; a
send puts a copy of the tensor into the neighbour's mailbox (as the links deliver a copy), and
each engine's run goes on its own thread, as each stage's does in its own process."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from pipesvc import models
from pipesvc.core import microbatch
from pipesvc.core.clipping import clip_scale, total_norm_sq
from pipesvc.core.config import JobConfig
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.planning import partition
from pipesvc.errors import StageUnavailableError
from pipesvc.stage.compute.engine import Carried, RunInputs, RunResult, SendFn, StepEngine
from pipesvc.stage.compute.faults import FaultKill
from pipesvc.stage.compute.recorder import RunRecorder
from pipesvc.stage.compute.runtime import StageRuntime
from pipesvc.stage.compute.sessions import SessionCaches
from pipesvc.stage.dataplane.mailbox import Mailbox, MailKey
from tests.support.reference import Problem

NUM_MICROBATCHES = 4
JOIN_TIMEOUT_S = 60.0


class Pipeline:
    """P engines of one job, wired by in-process sends; drives them as the coordinator does."""

    def __init__(
        self,
        problem: Problem,
        *,
        schedule_name: str,
        num_stages: int,
        seed: int,
        optimizer: Mapping[str, Any],
        clip_grad_norm: float | None,
        num_microbatches: int = NUM_MICROBATCHES,
        fault_kill: FaultKill | None = None,
        kv_budget: int = 2**30,
    ) -> None:
        self.config = JobConfig(
            model=problem.model,
            model_args=problem.model_args,
            seed=seed,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule_name,
            optimizer=optimizer,
            loss=problem.loss,
            clip_grad_norm=clip_grad_norm,
        )
        num_layers = len(models.build(problem.model, seed=seed, **problem.model_args))
        ranges = partition.uniform(num_layers, num_stages)
        self.mailboxes = [Mailbox() for _ in ranges]
        self.fail_send: tuple[int, int] | None = None
        """(rank, micro-batch): that rank's send of that micro-batch's activation raises."""
        runtimes = [
            StageRuntime(
                config=self.config,
                start_layer=start,
                end_layer=end,
                rank=rank,
                num_stages=num_stages,
                device=torch.device("cpu"),
            )
            for rank, (start, end) in enumerate(ranges)
        ]
        self.engines = [
            StepEngine(
                runtime=runtimes[rank],
                sessions=SessionCaches(
                    runtimes[rank].features.new_cache,
                    budget_bytes=kv_budget,
                    idle_s=60.0,
                    layout=runtimes[rank].features.cache_layout,
                ),
                mailbox=self.mailboxes[rank],
                send_activation=self._sender(rank, rank + 1),
                send_gradient=self._sender(rank, rank - 1),
                recorder=RunRecorder(),
                recv_timeout_s=JOIN_TIMEOUT_S / 2,
                fault_kill=fault_kill,
            )
            for rank, (start, end) in enumerate(ranges)
        ]
        self.run_id = 0

    def _sender(self, rank: int, to: int) -> SendFn:
        def send(key: MailKey, tensor: torch.Tensor) -> None:
            if self.fail_send == (rank, key.microbatch_index) and to > rank:
                raise StageUnavailableError(f"rank {rank} cannot send {key}")
            self.mailboxes[to].put(key, tensor.detach().clone())

        return send

    def run(
        self, x: torch.Tensor, y: torch.Tensor | None, run_id: int, commit: Carried | None = None
    ) -> list[RunResult | BaseException]:
        """Every engine's part of one run (carrying ``commit``), each on its own thread; a
        result or error each."""
        xs = microbatch.split(x, min(self.config.num_microbatches, x.shape[0]))
        ys = microbatch.split(y, len(xs)) if y is not None else []
        return self.run_batch(RunBatch(inputs=xs, targets=ys), run_id, commit)

    def run_batch(
        self,
        batch: RunBatch,
        run_id: int,
        commit: Carried | None = None,
        *,
        generating: bool = False,
    ) -> list[RunResult | BaseException]:
        """Every engine's part of the run of ``batch``."""
        xs, ys = batch.inputs, batch.targets
        weights = microbatch.loss_weights([len(t) for t in xs]) if ys else []
        last = len(self.engines) - 1
        results: list[RunResult | BaseException] = [
            TimeoutError(f"rank {r} did not finish") for r in range(len(self.engines))
        ]

        def run_one(rank: int, engine: StepEngine) -> None:
            try:
                results[rank] = engine.run_step(
                    run_id,
                    training=bool(ys),
                    num_microbatches=len(xs),
                    data=RunInputs(
                        inputs=xs if rank == 0 else [],
                        targets=ys if rank == last else [],
                        loss_weights=weights if rank == last else [],
                        side=batch.side,
                        caches=batch.caches,
                        greedy=batch.greedy,
                        decode_steps=batch.decode_steps,
                        sampling=batch.sampling if rank == last else [],
                    ),
                    commit=commit,
                    generating=generating,
                )
            except BaseException as exc:  # reported to the test thread
                results[rank] = exc
                # As the coordinator does once a stage reports a failed run.
                self.abort(run_id)

        threads = [
            threading.Thread(target=run_one, args=(rank, engine), daemon=True)
            for rank, engine in enumerate(self.engines)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
        return results

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Runs and commits one training step (global clipping as the coordinator does)."""
        self.run_id += 1
        results = self.run(x, y, self.run_id)
        replies = [r for r in results if isinstance(r, RunResult)]
        assert len(replies) == len(results), results
        scale = None
        if self.config.clip_grad_norm is not None:
            norms = [r.grad_norm_sq or 0.0 for r in replies]
            scale = clip_scale(total_norm_sq(norms), self.config.clip_grad_norm)
        for engine in self.engines:
            engine.commit(self.run_id, scale)
        return float(sum(replies[-1].losses))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.run_id += 1
        results = self.run(x, None, self.run_id)
        last = results[-1]
        assert isinstance(last, RunResult), results
        return torch.cat(last.outputs, dim=0)

    def abort(self, run_id: int) -> None:
        for engine in self.engines:
            engine.abort(run_id)

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for engine in self.engines:
            merged.update(engine.runtime.tensors(kind))
        return merged
