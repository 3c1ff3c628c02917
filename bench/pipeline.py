"""Training steps/s: pipesvc vs torch.distributed.pipelining vs one process, same model.

Two models, each split uniformly (``pipesvc.core.planning.partition.uniform``: equal layer counts)
over 2 or
4 stages, 8 micro-batches, SGD (lr 1e-3), one torch thread per stage process:

- mlp: 8 x (Linear(1024, 1024) + ReLU) (``bench-mlp``), batch 64, MSE loss.
- act: 8 x (Linear(256, 256) + ReLU), batch 4096: 512 KiB of activations per micro-batch for
  little compute (activation-heavy), MSE loss.
- gpt: the built-in ``gpt`` (vocabulary 128, sequence length 128, embedding 128, 4 heads,
  6 blocks: 8 layers, embedding + 6 blocks + head, 1.2M parameters), batch 16 sequences of
  128 random tokens, cross-entropy over the flattened logits (mean), as pipesvc's
  ``cross_entropy`` loss computes it.

- torch: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` over gloo, one process per
  stage (``init_method=tcp://127.0.0.1:PORT``), the stage's layers built with
  ``pipesvc.models.build`` and sliced to pipesvc's ranges. pipesvc's ``zb-h1`` rows compare
  with torch's 1F1B (torch's zero-bubble schedules hold two stages per rank); its
  ``interleaved-1f1b`` rows (``virtual_stages=2``) with torch's ``ScheduleInterleaved1F1B``
  over two ``PipelineStage`` per rank, cut into the same ranges.
- data parallel x pipeline ("2x2" rows): pipesvc ``data_parallel=2`` over 2-stage pipelines
  on 4 stage processes (8 micro-batches per replica); torch: 2 replicas of the same
  ``PipelineStage`` pipeline in one 4-process gloo world (a process group per pipeline), each
  on its half of the batch, and an all-reduce written here (one flat buffer per stage over a
  group of its replicas, then / 2) before ``opt.step()``: torch's DDP does not wrap a
  pipelining stage on CPU, so this is the composition a user would write.
- pipesvc: ``LocalCluster(num_stages=N, threads_per_stage=1)``, i.e. a coordinator plus N stage
  processes; timed from the client, with default settings: checkpoints at the default cadence
  (the first at step 10, then within 2% of the training time). Two columns: a loop of
  ``job.train_step`` ("pipesvc steps/s"), then as many pipelined steps through ``job.train``
  ("train steps/s": one stream, each step's run sent ahead of the step before's decision).
  Between stages: shared memory, or with ``--frames`` the frames on the gRPC streams that
  stages on different hosts use (``--shm-bytes 0``).
- one process: the unsplit model on the whole batch, 1 and 2 threads.

Both pipelines start from the same weights and batch, so their step-1 losses (the gpt table
shows them) must agree; a mismatch would mean they do not compute the same thing.

Usage: ``python bench/pipeline.py [--quick] [--frames] [--workloads mlp,gpt,act]``
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

import pipesvc
from pipesvc.core.planning.partition import uniform

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase

REPO_ROOT = Path(__file__).resolve().parents[1]
WIDTH, DEPTH, BATCH, NUM_MICROBATCHES, LR = 1024, 8, 64, 8, 1e-3
GPT_ARGS = {"vocab_size": 128, "block_size": 128, "embed_dim": 128, "num_heads": 4, "num_blocks": 6}
GPT_BATCH, SEQ_LEN = 16, 128
WARMUP_STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
TORCH_SCHEDULE = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "zb-h1": "1f1b",
    "interleaved-1f1b": "interleaved",
}
VIRTUAL_STAGES = 2
"""Layer ranges per stage in the interleaved rows (pipesvc and torch alike)."""
CLIP: float | None = None
"""Global-norm clipping in the torch baseline (``bench/overhead.py --clip``): each rank's
squared gradient norm summed over the pipeline with one all-reduce, as torchtitan clips a
pipeline; None for none."""
"""What each pipesvc schedule is compared with: torch has no single-stage-per-rank zero-bubble
schedule (its zero-bubble ones hold two stages per rank), so zb-h1 rows repeat its 1F1B."""
STAGE_COUNTS = (2, 4)
REPLICATED = {4: (2, 2)}
"""Cluster size -> (stages, replicas) of the data-parallel rows run on it."""
Queue = Any  # multiprocessing.Queue


@dataclass(frozen=True)
class Workload:
    """A model, its batch and its loss, as both pipelines and the one-process run see them."""

    name: str
    model: str
    """Registered model name (``pipesvc.models.build``)."""
    model_args: dict[str, int] = field(hash=False)
    loss: str
    """pipesvc loss name; :func:`_loss_fn` is the same function for torch."""
    num_layers: int


MLP = Workload("mlp", "bench-mlp", {"width": WIDTH, "depth": DEPTH}, "mse", DEPTH)
GPT = Workload("gpt", "gpt", GPT_ARGS, "cross_entropy", GPT_ARGS["num_blocks"] + 2)
ACT_WIDTH, ACT_BATCH = 256, 4096
ACT = Workload("act", "bench-mlp", {"width": ACT_WIDTH, "depth": DEPTH}, "mse", DEPTH)
"""Activation-heavy: 512 KiB of activations per micro-batch for little compute."""
WORKLOADS = {w.name: w for w in (MLP, GPT, ACT)}


def _model(w: Workload) -> torch.nn.Sequential:
    importlib.import_module("bench.bench_models")
    return pipesvc.models.build(w.model, seed=0, **w.model_args)


def _batch(w: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if w.name in ("mlp", "act"):
        batch, width = (BATCH, WIDTH) if w.name == "mlp" else (ACT_BATCH, ACT_WIDTH)
        return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    vocab = GPT_ARGS["vocab_size"]
    tokens = torch.randint(0, vocab, (GPT_BATCH, SEQ_LEN + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """pipesvc's ``cross_entropy`` (``pipesvc.core.loss.compute_loss``): mean over all tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _loss_fn(w: Workload) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return F.mse_loss if w.loss == "mse" else _lm_loss


def _time_steps(
    step: Any, num_steps: int, barrier: Any = None, mark: Callable[[], None] | None = None
) -> float:
    """Seconds for ``num_steps`` calls of ``step`` after the warm-up ones; ``mark`` (if given)
    is called just before the timed window opens and just after it closes, outside it (e.g. to
    read a network interface's byte counters over exactly the timed steps)."""
    for _ in range(WARMUP_STEPS):
        step()
    if barrier is not None:
        barrier()
    if mark is not None:
        mark()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    if barrier is not None:
        barrier()
    seconds = time.perf_counter() - start
    if mark is not None:
        mark()
    return seconds


def _one_process(q: Queue, workload: str, num_threads: int, num_steps: int) -> None:
    torch.set_num_threads(num_threads)
    w = WORKLOADS[workload]
    model, (x, y), loss_fn = _model(w), _batch(w), _loss_fn(w)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad()
        torch.autograd.backward(loss_fn(model(x), y))
        opt.step()

    q.put(("seconds", _time_steps(step, num_steps)))


def _pipe_step(
    pipe: Any, index: int, num_stages: int, x: torch.Tensor, y: torch.Tensor, first: list[float]
) -> None:
    """One ``pipe.step`` of pipeline stage ``index``: the first feeds the inputs, the last the
    targets (and keeps the first step's mean loss: equal micro-batches, so the batch mean)."""
    if index == 0:
        pipe.step(x)
    elif index == num_stages - 1:
        losses: list[torch.Tensor] = []
        pipe.step(target=y, losses=losses)
        if not first:
            first.append(sum(v.item() for v in losses) / len(losses))
    else:
        pipe.step()


def _join_gloo(address: str, rank: int, world: int) -> None:
    """One torch thread, and this process in the gloo world at ``address``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )


def _clip_across_ranks(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Scales this rank's gradients by the global norm over every rank's (one all-reduce)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    norm_sq = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    dist.all_reduce(norm_sq)
    scale = min(1.0, max_norm / (float(norm_sq.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(scale)


def _torch_stage(
    q: Queue,
    workload: str,
    rank: int,
    world: int,
    address: str,
    schedule: str,
    num_steps: int,
    mark: Callable[[], None] | None = None,
) -> None:
    """One rank of a torch pipeline; rank 0 puts the timed seconds on ``q``, the last rank the
    step-1 loss. ``mark``: see :func:`_time_steps` (``bench/links.py`` reads link counters)."""
    try:
        import torch.distributed as dist
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        _join_gloo(address, rank, world)
        w = WORKLOADS[workload]
        model = _model(w)
        if schedule == "interleaved":  # this rank's chunks: virtual stages r, r + P, ...
            cuts = uniform(w.num_layers, world * VIRTUAL_STAGES)
            indices = range(rank, world * VIRTUAL_STAGES, world)
            modules = [model[cuts[i][0] : cuts[i][1]] for i in indices]
            stages: list[_PipelineStageBase] = [
                PipelineStage(m, i, world * VIRTUAL_STAGES, torch.device("cpu"))
                for m, i in zip(modules, indices, strict=True)
            ]
            pipe: Any = ScheduleInterleaved1F1B(
                stages, n_microbatches=NUM_MICROBATCHES, loss_fn=_loss_fn(w)
            )
            params = [p for m in modules for p in m.parameters()]
        else:
            start, end = uniform(w.num_layers, world)[rank]
            submodule = model[start:end]
            stage = PipelineStage(submodule, rank, world, torch.device("cpu"))
            schedule_cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            pipe = schedule_cls(stage, n_microbatches=NUM_MICROBATCHES, loss_fn=_loss_fn(w))
            params = list(submodule.parameters())
        opt = torch.optim.SGD(params, lr=LR)
        x, y = _batch(w)
        first_losses: list[float] = []

        def step() -> None:
            opt.zero_grad()
            _pipe_step(pipe, rank, world, x, y, first_losses)
            if CLIP is not None:
                _clip_across_ranks(params, CLIP)
            opt.step()

        seconds = _time_steps(step, num_steps, dist.barrier, mark)
        dist.destroy_process_group()
        if rank == 0:
            q.put(("seconds", seconds))
        if rank == world - 1:
            q.put(("loss", first_losses[0]))
    except Exception as exc:
        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _torch_replicated_stage(
    q: Queue,
    workload: str,
    rank: int,
    world: int,
    address: str,
    schedule: str,
    num_steps: int,
    num_stages: int,
) -> None:
    """One stage of ``world // num_stages`` replicas of a torch pipeline, with its gradients
    averaged over its replicas by an all-reduce before each optimizer step."""
    try:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        _join_gloo(address, rank, world)
        replicas = world // num_stages
        replica, index = divmod(rank, num_stages)
        # Every rank creates every group, in the same order (torch requires it).
        pipelines = [
            dist.new_group([r * num_stages + k for k in range(num_stages)]) for r in range(replicas)
        ]
        columns = [
            dist.new_group([r * num_stages + k for r in range(replicas)]) for k in range(num_stages)
        ]
        w = WORKLOADS[workload]
        start, end = uniform(w.num_layers, num_stages)[index]
        submodule = _model(w)[start:end]
        stage = PipelineStage(
            submodule, index, num_stages, torch.device("cpu"), group=pipelines[replica]
        )
        schedule_cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        pipe = schedule_cls(stage, n_microbatches=NUM_MICROBATCHES, loss_fn=_loss_fn(w))
        opt = torch.optim.SGD(submodule.parameters(), lr=LR)
        x, y = (t.chunk(replicas)[replica].contiguous() for t in _batch(w))
        params = [p for p in submodule.parameters() if p.requires_grad]
        first_losses: list[float] = []

        def step() -> None:
            opt.zero_grad()
            _pipe_step(pipe, index, num_stages, x, y, first_losses)
            grads = [p.grad for p in params if p.grad is not None]
            flat = torch._utils._flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]
            dist.all_reduce(flat, group=columns[index])
            flat /= replicas
            for grad, summed in zip(
                grads,
                torch._utils._unflatten_dense_tensors(flat, grads),  # type: ignore[no-untyped-call]
                strict=True,
            ):
                grad.copy_(summed)
            opt.step()

        seconds = _time_steps(step, num_steps, dist.barrier)
        dist.destroy_process_group()
        if rank == 0:
            q.put(("seconds", seconds))
        if index == num_stages - 1:
            q.put((f"loss{replica}", first_losses[0]))
    except Exception as exc:
        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _run_children(
    targets: list[tuple[Any, tuple[Any, ...]]], expect: tuple[str, ...] = ("seconds",)
) -> dict[str, float] | str:
    """Runs the processes; returns the ``expect``ed results, or the first error message."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=t, args=(q, *a), daemon=True) for t, a in targets]
    for proc in procs:
        proc.start()
    results: dict[str, float] = {}
    error = ""
    while not error and not all(k in results for k in expect):
        try:
            kind, value = q.get(timeout=900)
        except Exception as exc:
            kind, value = "error", f"no result within 900 s ({type(exc).__name__})"
        if kind == "error":
            error = str(value)
        else:
            results[kind] = float(value)
    for proc in procs:
        proc.join(timeout=1 if error else 30)
        if proc.is_alive():
            proc.terminate()
    return error or results


def torch_pipelining(
    w: Workload, schedule: str, world: int, num_steps: int
) -> tuple[float, float] | str:
    """(steps/s, step-1 loss) of torch.distributed.pipelining, or why it failed."""
    address = _free_address()
    targets = [
        (_torch_stage, (w.name, r, world, address, schedule, num_steps)) for r in range(world)
    ]
    result = _run_children(targets, expect=("seconds", "loss"))
    if isinstance(result, str):
        return result
    return num_steps / result["seconds"], result["loss"]


def torch_replicated(
    w: Workload, schedule: str, num_stages: int, replicas: int, num_steps: int
) -> tuple[float, float] | str:
    """(steps/s, step-1 loss) of ``replicas`` torch pipelines with an all-reduce, or why it
    failed."""
    address = _free_address()
    world = num_stages * replicas
    targets = [
        (
            _torch_replicated_stage,
            (w.name, r, world, address, schedule, num_steps, num_stages),
        )
        for r in range(world)
    ]
    expect = ("seconds", *(f"loss{r}" for r in range(replicas)))
    result = _run_children(targets, expect=expect)
    if isinstance(result, str):
        return result
    loss = sum(result[f"loss{r}"] for r in range(replicas)) / replicas
    return num_steps / result["seconds"], loss


def one_process(w: Workload, num_threads: int, num_steps: int) -> float:
    """Steps/s of the unsplit model in a fresh process."""
    result = _run_children([(_one_process, (w.name, num_threads, num_steps))])
    if isinstance(result, str):
        raise RuntimeError(result)
    return num_steps / result["seconds"]


def _time_job(
    job: pipesvc.Job, x: torch.Tensor, y: torch.Tensor, num_steps: int
) -> tuple[float, float, float]:
    """(steps/s, step-1 loss) of ``job.train_step`` timed from the client, then the steps/s
    of as many pipelined steps (``job.train``)."""
    losses: list[float] = []
    seconds = _time_steps(lambda: losses.append(job.train_step(x, y)), num_steps)
    started = time.perf_counter()
    for _ in job.train([(x, y)] * num_steps):
        pass
    return num_steps / seconds, losses[0], num_steps / (time.perf_counter() - started)


def pipesvc_steps_per_s(
    num_stages: int, steps: dict[str, int], frames: bool = False
) -> dict[tuple[str, str, int], tuple[float, float, float]]:
    """``{(workload, schedule, replicas): (steps/s, step-1 loss, job.train steps/s)}`` on one
    fresh local cluster
    of ``num_stages`` stages, timing ``steps[workload]`` steps of each job: one pipeline over
    every stage, and (``REPLICATED``) replicas of a shorter one; ``frames``: shared memory off,
    tensors as frames on the gRPC streams, as between hosts."""
    layouts = [(num_stages, 1)]
    if num_stages in REPLICATED:
        layouts.append(REPLICATED[num_stages])
    results = {}
    with pipesvc.LocalCluster(
        num_stages=num_stages,
        models=["bench.bench_models"],
        threads_per_stage=1,
        stage_args=["--shm-bytes", "0"] if frames else [],
    ) as cluster:
        client = cluster.connect()
        for name, num_steps in steps.items():
            w = WORKLOADS[name]
            x, y = _batch(w)
            for stages, replicas, schedule in _rows(layouts):
                virtual = VIRTUAL_STAGES if schedule == "interleaved-1f1b" else 1
                job = client.create_job(
                    model=w.model,
                    model_args=w.model_args,
                    num_stages=stages,
                    virtual_stages=virtual,
                    data_parallel=replicas,
                    num_microbatches=NUM_MICROBATCHES,
                    schedule=schedule,
                    optimizer={"name": "sgd", "lr": LR},
                    loss=w.loss,
                    partition="uniform",
                )
                plan = [(s.start_layer, s.end_layer) for s in job.plan]
                expected_plan = uniform(w.num_layers, stages * virtual) * replicas
                if plan != expected_plan:  # the torch side slices the model this way
                    raise RuntimeError(f"pipesvc planned {plan}, torch uses {expected_plan}")
                results[name, schedule, replicas] = _time_job(job, x, y, num_steps)
                job.close()
        client.close()
    return results


def _rows(layouts: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
    """(stages, replicas, schedule) of each row: every schedule on one pipeline; the
    replicated rows without interleaving (its torch baseline is not built here)."""
    return [
        (stages, replicas, schedule)
        for (stages, replicas), schedule in itertools.product(layouts, SCHEDULES)
        if replicas == 1 or schedule != "interleaved-1f1b"
    ]


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="10 (mlp) and 5 (gpt, act) timed steps instead of 20, 10, 10",
    )
    parser.add_argument(
        "--frames",
        action="store_true",
        help="pipesvc stages with shared memory off (--shm-bytes 0): frames on the streams",
    )
    parser.add_argument("--workloads", default="mlp,gpt,act")
    args = parser.parse_args()
    full = {"mlp": 10, "gpt": 5, "act": 5} if args.quick else {"mlp": 20, "gpt": 10, "act": 10}
    steps = {name: full[name] for name in args.workloads.split(",")}
    sys.path.insert(0, str(REPO_ROOT))  # spawned children inherit sys.path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # for the stage processes, which import bench.bench_models
    single = {
        (name, n): one_process(WORKLOADS[name], n, num_steps)
        for name, num_steps in steps.items()
        for n in (1, 2)
    }
    errors: dict[str, str] = {}
    header = ["schedule", "stages", "torch steps/s", "pipesvc steps/s", "pipesvc/torch"]
    header += ["pipesvc/1proc(2thr)", "train steps/s", "train/torch"]
    tables: dict[str, list[list[str]]] = {
        name: [[*header, "step-1 loss torch", "step-1 loss pipesvc"] if name == "gpt" else header]
        for name in steps
    }
    for num_stages in STAGE_COUNTS:
        ours = pipesvc_steps_per_s(num_stages, steps, args.frames)
        layouts = [(num_stages, 1)] + ([REPLICATED[num_stages]] if num_stages in REPLICATED else [])
        for name, num_steps in steps.items():
            measured: dict[tuple[str, int], tuple[float, float] | str] = {}
            for stages, replicas, schedule in _rows(layouts):
                rate, loss, train_rate = ours[name, schedule, replicas]
                against = TORCH_SCHEDULE[schedule]
                if (against, replicas) not in measured:
                    measured[against, replicas] = (
                        torch_pipelining(WORKLOADS[name], against, stages, num_steps)
                        if replicas == 1
                        else torch_replicated(WORKLOADS[name], against, stages, replicas, num_steps)
                    )
                theirs = measured[against, replicas]
                shape = f"{replicas}x{stages}" if replicas > 1 else str(stages)
                if isinstance(theirs, str):
                    errors[f"{name}, {schedule} x {shape}"] = theirs
                    cells = ["failed", "n/a", "n/a"]
                    their_loss = "n/a"
                else:
                    ratios = (rate / theirs[0], train_rate / theirs[0])
                    cells = [f"{theirs[0]:.2f}", *(f"{r:.2f}" for r in ratios)]
                    their_loss = f"{theirs[1]:.5f}"
                row = [schedule, shape, cells[0], f"{rate:.2f}", cells[1]]
                row += [f"{rate / single[name, 2]:.2f}", f"{train_rate:.2f}", cells[2]]
                if name == "gpt":
                    row += [their_loss, f"{loss:.5f}"]
                tables[name].append(row)
    timed = ", ".join(f"{n} ({name})" for name, n in steps.items())
    common = (
        f"{NUM_MICROBATCHES} micro-batches, SGD; {WARMUP_STEPS} warm-up + {timed} timed "
        f"steps;\n1 thread per stage process (pipesvc adds a coordinator process); "
        f"{os.cpu_count()} CPU cores; pipesvc between stages: "
        f"{'frames on the gRPC streams (shared memory off)' if args.frames else 'shared memory'}."
    )
    print(
        f"\nTraining steps/s, mlp: {DEPTH} x (Linear({WIDTH}, {WIDTH}) + ReLU), batch {BATCH}, "
        f"MSE; gpt: {GPT.num_layers} layers ({GPT_ARGS['num_blocks']} blocks, embedding "
        f"{GPT_ARGS['embed_dim']}, {GPT_ARGS['num_heads']} heads, vocabulary "
        f"{GPT_ARGS['vocab_size']}), batch {GPT_BATCH} x {SEQ_LEN} tokens, cross-entropy; "
        f"act: {DEPTH} x (Linear({ACT_WIDTH}, {ACT_WIDTH}) + ReLU), batch {ACT_BATCH} "
        f"({ACT_BATCH // NUM_MICROBATCHES * ACT_WIDTH * 4 // 1024} KiB of activations per "
        f"micro-batch), MSE;\n{common}"
    )
    for name in steps:
        print(f"\n{name}:\n")
        _print_table(tables[name])
    print()
    rows = [["one process, whole batch"]]
    for name in steps:
        rows[0] += [f"{name} steps/s", "vs 2 threads"]
    for n in (1, 2):
        row = [f"{n} thread{'s' if n > 1 else ''}"]
        for name in steps:
            row += [f"{single[name, n]:.2f}", f"{single[name, n] / single[name, 2]:.2f}"]
        rows.append(row)
    _print_table(rows)
    for where, message in errors.items():
        print(f"\ntorch.distributed.pipelining failed ({where}):\n{message}")


if __name__ == "__main__":
    main()
