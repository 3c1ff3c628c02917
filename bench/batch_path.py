"""CPU cost per MiB of a training step's batch on its way from the client to the stages.

Everything one step's batch goes through in the three processes, minus the sockets: the
client encodes its TrainStep, the coordinator parses it, splits the batch into micro-batches
and encodes the RunStep of rank 0 (inputs) and of the last rank (targets), and each of the two
stages parses its RunStep and decodes its tensors. Two ways, timed in turns in one process so
that both see the same load:

- **protobuf**: the encoding before [Note: payload wire]: each tensor a ``Tensor`` message with
  its bytes in ``data`` (``tensor_codec.encode``/``decode``), every request built and parsed by
  protobuf.
- **payloads**: the tensors' bytes beside the message (``pipesvc/wire/payload_wire.py``), with
  the functions the client (``client.training.train_request``), coordinator (``step_request.
  train_batch``, ``StageGroup.run_step``'s views) and stage (``StageService.RunStep``: inputs
  copied on the CPU, targets viewed) use.

gRPC's own copies (into and out of its buffers) and the sockets are the same for both and left
out. Rows: the activation-heavy batch of ``bench/pipeline.py`` (``act``: float32 inputs and
targets of 4096 x 256, 8 MiB) and a larger one, in 8 micro-batches.

Usage: ``python bench/batch_path.py [--rounds 40]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipesvc.client.training import train_request
from pipesvc.coordinator.step_request import train_batch
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.tensor_codec import CodecLimits, decode, encode, payload_view
from pipesvc.v1 import coordinator_pb2, stage_pb2
from pipesvc.wire.payload_wire import RUN_STEP, TRAIN_STEP, Incoming, Payloads

MIB = 1 << 20
NUM_MICROBATCHES = 8
LIMITS = CodecLimits()
ROWS = {"act (4096 x 256)": (4096, 256), "4x act (16384 x 256)": (16384, 256)}


def protobuf_path(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Seconds of each process's part of one step, the old way."""
    t0 = time.perf_counter()
    wire = coordinator_pb2.TrainStepRequest(
        job_id="j", inputs=encode(x), targets=encode(y), request_id="r"
    ).SerializeToString()
    t1 = time.perf_counter()
    request = coordinator_pb2.TrainStepRequest.FromString(wire)
    inputs, targets = decode(request.inputs, LIMITS), decode(request.targets, LIMITS)
    batch = RunBatch.split(inputs, targets, None, NUM_MICROBATCHES)
    first = stage_pb2.RunStepRequest(
        job_id="j", num_microbatches=NUM_MICROBATCHES, inputs=[encode(t) for t in batch.inputs]
    ).SerializeToString()
    last = stage_pb2.RunStepRequest(
        job_id="j", num_microbatches=NUM_MICROBATCHES, targets=[encode(t) for t in batch.targets]
    ).SerializeToString()
    t2 = time.perf_counter()
    got_x = [decode(t, LIMITS) for t in stage_pb2.RunStepRequest.FromString(first).inputs]
    got_y = [decode(t, LIMITS) for t in stage_pb2.RunStepRequest.FromString(last).targets]
    t3 = time.perf_counter()
    assert len(got_x) == len(got_y) == NUM_MICROBATCHES
    return {"client": t1 - t0, "coordinator": t2 - t1, "stages": t3 - t2}


def payload_path(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Seconds of each process's part of one step, with the payloads beside the messages."""
    t0 = time.perf_counter()
    wire = TRAIN_STEP.serialize(train_request("j", x, y, None, "r"))
    t1 = time.perf_counter()
    step = train_batch(TRAIN_STEP.parse(wire), LIMITS)
    batch = RunBatch.split(step.inputs, step.targets, step.side, NUM_MICROBATCHES)
    wires = []
    for name, tensors in (("inputs", batch.inputs), ("targets", batch.targets)):
        payloads = Payloads()
        message = stage_pb2.RunStepRequest(job_id="j", num_microbatches=NUM_MICROBATCHES)
        getattr(message, name).extend(payloads.add(*payload_view(t)) for t in tensors)
        wires.append(RUN_STEP.serialize(RUN_STEP.outgoing(message, payloads)))
    t2 = time.perf_counter()
    first, last = (RUN_STEP.parse(w) for w in wires)
    assert isinstance(first, Incoming) and isinstance(last, Incoming)
    got_x = [decode(t, LIMITS, first.payloads, copy=True) for t in first.message.inputs]
    got_y = [decode(t, LIMITS, last.payloads, copy=False) for t in last.message.targets]
    t3 = time.perf_counter()
    assert len(got_x) == len(got_y) == NUM_MICROBATCHES
    return {"client": t1 - t0, "coordinator": t2 - t1, "stages": t3 - t2}


PATHS: dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, float]]] = {
    "protobuf": protobuf_path,
    "payloads": payload_path,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per way and row")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"{args.rounds} rounds per way and row, in turns (3 warm-up); {NUM_MICROBATCHES} "
        f"micro-batches; {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.1f}; "
        "medians, ms per MiB of batch (inputs + targets)"
    )
    header = ["batch", "way", "client", "coordinator", "stages", "total", "ms/step", "vs protobuf"]
    rows = [header]
    for label, (batch, width) in ROWS.items():
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
        mib = (x.nbytes + y.nbytes) / MIB
        times: dict[str, list[dict[str, float]]] = {name: [] for name in PATHS}
        for i in range(args.rounds + 3):
            order = list(PATHS) if i % 2 else list(reversed(PATHS))
            for name in order:
                parts = PATHS[name](x, y)
                if i >= 3:
                    times[name].append(parts)
        baseline = 0.0
        for name in PATHS:
            medians = {
                part: statistics.median(t[part] for t in times[name]) * 1e3
                for part in ("client", "coordinator", "stages")
            }
            total = statistics.median(sum(t.values()) for t in times[name]) * 1e3
            baseline = baseline or total
            rows.append(
                [
                    f"{label}, {mib:.0f} MiB",
                    name,
                    *(f"{medians[p] / mib:.3f}" for p in ("client", "coordinator", "stages")),
                    f"{total / mib:.3f}",
                    f"{total:.1f}",
                    f"{total / baseline:.2f}x",
                ]
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
