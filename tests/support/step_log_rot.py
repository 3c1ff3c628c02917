"""Bit rot in a step log: one bit of a step's newest record's payload flipped on disk, its
header and trailer left whole, so that only the record's checksum can tell (see [Note: step
log segments] in pipesvc/coordinator/step_log.py)."""

from __future__ import annotations

from collections.abc import Callable

from pipesvc.coordinator import step_log


def flip_payload_bit(
    log: step_log.StepLog, step: int, where: Callable[[int], int], bit: int
) -> None:
    """Flips bit ``bit`` of the payload byte ``where(length)`` of ``step``'s newest record in
    ``log`` (``length``: the payload's bytes)."""
    path = log.entries()[step]
    record = [r for r in step_log._read_segment(path).records if r.step == step][-1]
    at = record.offset + where(record.length)
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)[0]
        file.seek(at)
        file.write(bytes([byte ^ (1 << bit)]))
