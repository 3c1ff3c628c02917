"""A job's checkpoints: which steps get one (the cadence), the snapshots a carrying run takes,
reading the live state, and the background writer that makes them durable.

[Note: background checkpoint] is in docs/architecture.md: a periodic checkpoint's state is read
with the stages at the step, then written on the job's pool; it counts once durable. The writer
on the pool only writes files; the checkpoint counts (``Ledger.checkpointed``, the row, the
pruning) on the job's thread, in ``finish``, with the job's lock held like every other part.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent import futures
from pathlib import Path

import torch

from pipesvc.coordinator.database import JobRecord
from pipesvc.coordinator.job_storage import JobStorage
from pipesvc.coordinator.ledger import Ledger
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.core.cadence import CheckpointCadence, log_bound
from pipesvc.core.tensor_codec import read_named_frames
from pipesvc.errors import InternalError
from pipesvc.storage.checkpoint import CheckpointWriter
from pipesvc.v1 import common_pb2

logger = logging.getLogger(__name__)

CHECKPOINT_BUFFER_BYTES = 256 << 20
"""A periodic checkpoint whose state fits in this much coordinator memory is written in the
background; a larger one is written while it streams, one layer in memory at a time."""


class Checkpointer:
    """Takes a job's checkpoints and makes them count once durable (at most one in flight)."""

    def __init__(
        self,
        *,
        group: StageGroup,
        ledger: Ledger,
        storage: JobStorage,
        pool: futures.ThreadPoolExecutor,
    ) -> None:
        self._group = group
        self._ledger = ledger
        self._storage = storage
        self._pool = pool
        self._writing: tuple[int, float, futures.Future[float]] | None = None
        """A checkpoint being written in the background: (step, seconds reading it, write)."""
        self._sized: tuple[int, int] | None = None
        """(checkpoint step, its bytes on disk), as ``_checkpoint_bytes`` last counted."""
        self.cadence = CheckpointCadence(
            group.config.checkpoint_every, start_step=max(ledger.checkpoint_step, 0)
        )
        """Which steps get a periodic checkpoint (see [Note: checkpoint cadence])."""

    # -- which steps -----------------------------------------------------------------------------

    def after_step(self, took: float) -> None:
        """A training step was decided in ``took`` seconds: if the cadence (or the bound on a
        ``checkpoint_every=0`` job's step log) says its step is due a checkpoint, the run that
        carries its commit has the stages snapshot their state, which then streams to a
        checkpoint while later steps train (see [Note: snapshot checkpoint] in
        stage/compute/engine.py); with no such run, the flush of the commit reads the stages instead
        (``flush``)."""
        ledger, cadence = self._ledger, self.cadence
        cadence.step_took(took)
        due = cadence.due(ledger.step) or self.log_over_bound()
        pending, ahead = ledger.pending, ledger.run_ahead
        if ahead is not None and pending is not None and ahead[1] == pending.run_id:
            return  # its commit went out already (see [Note: steps ahead]): the next step's
        if due and pending is not None:
            cadence.asked(ledger.step)
            ledger.snapshot_due()

    def would_snapshot(self, step: int) -> bool:
        """Whether ``step`` would be due a checkpoint if decided now (see ``after_step``)."""
        return self.cadence.due(step) or self.log_over_bound()

    def log_over_bound(self) -> bool:
        """Whether a ``checkpoint_every=0`` job's step log has outgrown its bound, so that a
        checkpoint must prune it (see [Note: checkpoint cadence]); False while one is being
        written (it prunes the log once durable)."""
        if self._group.config.checkpoint_every != 0 or self._writing is not None:
            return False
        held = self._storage.log.size_bytes()
        bound = log_bound(self._checkpoint_bytes())
        if held <= bound:
            return False
        logger.warning(
            "job %s: checkpoint_every=0, and the step log since step %d holds %.1f MiB, more "
            "than its bound of %.1f MiB (a checkpoint's size, at least 64 MiB): taking a "
            "checkpoint at step %d to prune it",
            self._group.job_id,
            max(self._ledger.checkpoint_step, 0),
            held / 2**20,
            bound / 2**20,
            self._ledger.step,
        )
        return True

    def _checkpoint_bytes(self) -> int:
        """Bytes of the job's checkpoint on disk, or of its weights before it has one."""
        step = self._ledger.checkpoint_step
        if self._sized is None or self._sized[0] != step:
            directory = self._storage.checkpoints.path(step)
            if step >= 0 and directory.is_dir():
                size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
            else:
                size = sum(layer.parameter_bytes for layer in self._group.layers)
            self._sized = (step, size)
        return self._sized[1]

    # -- taking one ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Commits the pending decided step on every stage now (``Ledger.flush``; see [Note:
        deferred commit] in job.py), for a call that must see the committed weights; a step due
        a periodic checkpoint then gets it from the stages' live state, since no run carried
        its commit to snapshot them.

        Raises:
            PipesvcError: the commit did not reach every stage; the step is the replay target
                (every later call first rebuilds the stages to it).
        """
        flushed = self._ledger.flush()
        if flushed is not None and flushed.snapshot:
            self.checkpoint(background=True)

    def before_run(self, snapshot: bool) -> None:
        """A run is about to start; ``snapshot``: it carries a commit due a checkpoint, so the
        previous checkpoint's snapshot must be read first (each stage holds one)."""
        if snapshot:
            self.finish(wait=True)

    def checkpoint(self, *, background: bool = False) -> None:
        """Streams every stage's weights and optimizer state to a new checkpoint on disk (the
        pending commit is flushed first: this is the checkpoint).

        ``background``: once the state is read (the stages must be at the step for that), the
        files are written and synced on the job's pool while later steps run, if the state
        fits in ``CHECKPOINT_BUFFER_BYTES``; the checkpoint counts (and the step log behind it
        is pruned) only once it is durable (see [Note: background checkpoint]).
        """
        self._ledger.flush()
        self.finish(wait=True)  # one at a time, in step order
        started = time.monotonic()
        group, step = self._group, self._ledger.step
        directory = self._storage.checkpoints.path(step)
        record = self._ledger.record()
        buffered: list[tuple[str, torch.Tensor]] = []
        size = 0
        writer: CheckpointWriter | None = None
        try:
            for name, tensor in read_named_frames(group.stream_state(common_pb2.CHECKPOINT)):
                if writer is None:
                    size += tensor.numel() * tensor.element_size()
                    if background and size <= CHECKPOINT_BUFFER_BYTES:
                        buffered.append((name, tensor))
                        continue
                    writer = CheckpointWriter(directory)
                    for entry in buffered:
                        writer.add(*entry)
                    buffered = []
                writer.add(name, tensor)
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        read_s = time.monotonic() - started
        if writer is None:
            future = self._pool.submit(self._write, directory, buffered, record, step)
            self._writing = (step, read_s, future)
            return
        self._finish_writer(writer, record, step)
        self._checkpointed(step, read_s, time.monotonic() - started - read_s, background=False)

    def stream_snapshot(self, step: int) -> None:
        """After a run carried the commit of ``step`` with a snapshot: streams the stages'
        snapshots to a new checkpoint on the job's pool while later steps run (see [Note:
        snapshot checkpoint] in stage/compute/engine.py); it counts once durable, like a background
        write (see [Note: background checkpoint])."""
        self.finish(wait=True)  # one at a time, in step order
        frames = self._group.stream_state(
            common_pb2.CHECKPOINT, snapshot_step=step, plan=list(self._group.primary)
        )  # drawn on the pool, from the plan of now
        future = self._pool.submit(
            self._write,
            self._storage.checkpoints.path(step),
            read_named_frames(frames),
            self._ledger.record(),
            step,
        )
        self._writing = (step, 0.0, future)

    def start_lineage(self, step: int | None) -> None:
        """The stages hold a state just loaded at ``step`` (None: the job's): it becomes the
        job's step and its checkpoint. When ``step`` is below the job's, the steps after it
        (their logged batches, newer checkpoints) belong to a superseded lineage: the new
        checkpoint becomes the one recovery restores before any of them is removed (see
        ``_checkpointed``), so the database always names a checkpoint on disk, and the step log
        drops its entries past ``step`` (the job's lock is held: no entry is being written).

        Raises:
            PipesvcError, OSError: the checkpoint failed; the load does not count, and the next
                call first rebuilds the stages to the job's state before it.
        """
        self.finish(wait=True)  # a background write must not land after this one
        ledger = self._ledger
        step = ledger.step if step is None else step
        older = step < max(ledger.step, ledger.checkpoint_step)
        before = ledger.loaded(step)
        try:
            self.checkpoint()
        except BaseException:
            # Not durable, so not loaded: the stages go back to what the database says.
            ledger.unloaded(before)
            raise
        self.cadence.restart(step)
        if older:
            self._storage.log.drop_after(step)
            logger.info(
                "job %s: state loaded at step %d starts a new lineage; later checkpoints and "
                "logged steps are dropped",
                self._group.job_id,
                step,
            )

    # -- writing one -----------------------------------------------------------------------------

    def _write(
        self,
        directory: Path,
        entries: Iterable[tuple[str, torch.Tensor]],
        record: JobRecord,
        step: int,
    ) -> float:
        """Writes a checkpoint read earlier, or streaming in as ``entries`` are drawn (on the
        pool); returns the seconds it took."""
        started = time.monotonic()
        writer = CheckpointWriter(directory)
        try:
            for entry in entries:
                writer.add(*entry)
        except BaseException:
            writer.discard()
            raise
        self._finish_writer(writer, record, step)
        return time.monotonic() - started

    def _finish_writer(self, writer: CheckpointWriter, record: JobRecord, step: int) -> None:
        group = self._group
        try:
            # Coverage is by layer count (see [Note: checkpoint coverage]); that each layer
            # sent all its tensors is checked here, against the model, before the step log
            # behind this checkpoint is pruned.
            expected = {f"{layer.index}.{t.name}" for layer in group.layers for t in layer.tensors}
            missing = sorted(expected - writer.keys)
            if missing:
                raise InternalError(
                    f"the stages sent a checkpoint without {len(missing)} of the model's "
                    f"{len(expected)} tensors, e.g. {missing[:5]}"
                )
            writer.finish(
                job_id=group.job_id,
                step=step,
                spec=record.spec,
                num_layers=len(group.layers),
                plan=record.plan,
            )
        except BaseException:
            writer.discard()
            raise

    def finish(self, *, wait: bool) -> None:
        """Makes a checkpoint written in the background count once it is durable (``wait``:
        waits for it). A write that failed is dropped with a warning: the previous checkpoint
        and the step log behind it still cover every step."""
        if self._writing is None:
            return
        step, read_s, future = self._writing
        if not wait and not future.done():
            return
        self._writing = None
        try:
            write_s = future.result()
        except Exception as exc:  # any failure of the write only drops this checkpoint
            logger.warning(
                "job %s: writing the checkpoint of step %d failed; the one of step %d and the "
                "step log still cover it: %s",
                self._group.job_id,
                step,
                self._ledger.checkpoint_step,
                exc,
            )
            return
        self._checkpointed(step, read_s, write_s, background=True)

    def _checkpointed(self, step: int, read_s: float, write_s: float, *, background: bool) -> None:
        """A checkpoint of ``step`` is durable: it becomes the one recovery restores."""
        self._ledger.checkpointed(step)
        self.cadence.checkpointed(step, read_s + write_s)
        self._ledger.persist()  # the pointer moves first; what it no longer needs goes after
        self._storage.log.prune(step)
        self._storage.checkpoints.prune(current=step)
        logger.info(
            "job %s: checkpoint at step %d in %.3f s (state read in %.3f s, written in %.3f s%s)",
            self._group.job_id,
            step,
            read_s if background else read_s + write_s,
            read_s,
            write_s,
            " in the background" if background else "",
        )
