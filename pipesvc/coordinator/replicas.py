"""Replicas of a job's pipeline (data parallel x pipeline): the key-value store their gradient
groups meet at, and how a step's replies read across replicas.

[Note: replicas] A job with ``data_parallel=R`` runs R copies of its ``num_stages``-stage
pipeline on ``R x num_stages`` stages, cut the same way; the plan lists every stage with its
``replica`` (replica-major, each replica in rank order). A training step is cut into
``R x num_microbatches`` micro-batches, weighted over the whole batch (see [Note: uneven
micro-batches]); replica ``r`` runs a contiguous share of them (``replica_shares``), and each
stage draws training randomness by the micro-batch's index in the whole step, so every replica
computes exactly the terms one process would. Before a stage replies to the run, it sums its
gradients with the stages of the same rank in the other replicas: a gloo all-reduce over a
process group of the job, plan epoch, generation and rank (see [Note: gradient group] in
``pipesvc.stage.collective.replica_group``). The sum of weighted terms is the whole batch's
gradient, so no division follows. The global norm for clipping is read from replica 0 alone
(after the sum every replica holds the same gradients). The commit, the abort and the deferred
commit go to all ``R x num_stages`` stages as one (see [Note: commit]): all or none.

Checkpoints, state reads and generation use replica 0; state loads and recovery restores go to
every replica. A lost stage is replaced by a spare in its place; with none, a job whose
``min_replicas`` allows it drops the replicas that lost stages, and the survivors share the
same ``R x num_microbatches`` micro-batches, so the step's terms do not change. Either way the
plan gets a new epoch, so the groups are formed afresh.

The store is a ``torch.distributed.TCPStore`` served by the coordinator process on
``store_port`` (0: a free port, chosen when the first job with replicas needs it); stages
reach it at ``store_host``, or by default at the host of the coordinator address they
registered with. It carries only the groups' rendezvous keys; like the gloo links it has no
token or TLS, so it belongs on the cluster's own network (see docs/deploy.md).

[Note: store keys] Forming a group leaves gloo's keys in the store (one per member), and the
members' last meeting leaves its keys too; every aborted run starts a new generation, so a
store that kept them would grow with every abort for the life of the coordinator. The keys of a
job live under ``group_keys.job_prefix``, each generation under its own prefix, and only the
coordinator knows which generation is current: when a run names a new (epoch, generation) of a
job, the keys of every other generation of that job are deleted, and all of a job's keys when
it closes. A stage still forming a group of a past generation (its run was aborted) may then
wait for a key that is gone; it would have waited as long for the member that aborted, and its
group is torn down once formed or failed. So the store holds at most the current generation's
keys of each open job.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from torch import distributed

from pipesvc.core import group_keys
from pipesvc.core.clipping import total_norm_sq
from pipesvc.errors import StageUnavailableError
from pipesvc.v1 import common_pb2, stage_pb2

logger = logging.getLogger(__name__)

_c10d: Any = distributed  # TCPStore is not in torch's public stubs


class Rendezvous:
    """The coordinator's key-value store for gradient groups, started on first use."""

    def __init__(self, *, host: str = "", port: int = 0, bind: str = "0.0.0.0") -> None:
        self._host, self._port, self._bind = host, port, bind
        self._store: Any = None
        self._store_id = ""
        self._current: dict[str, tuple[int, int]] = {}
        """Each job's (epoch, generation) whose keys the store keeps."""
        self._lock = threading.Lock()

    def spec(self, job_id: str, epoch: int, generation: int) -> stage_pb2.ReplicaGroup:
        """Where a run of ``job_id`` at plan ``epoch`` and ``generation`` forms and meets its
        gradient groups (the store is started if it is not yet); the first call for a new
        generation deletes the job's keys of every other one (see [Note: store keys]).

        Raises:
            StageUnavailableError: the store could not listen on its port.
        """
        with self._lock:
            if self._store is None:
                # A stage keeps its group while runs name the same store: the nonce tells this
                # start of the store from an earlier one on the same port (see [Note:
                # gradient group]).
                self._store_id = secrets.token_hex(8)
                try:
                    self._store = _c10d.TCPStore(
                        self._bind,
                        self._port,
                        is_master=True,
                        wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=300),
                    )
                except RuntimeError as exc:
                    raise StageUnavailableError(
                        f"the gradient-group store could not listen on {self._bind}:"
                        f"{self._port}: {str(exc).splitlines()[0]}"
                    ) from exc
                logger.info("gradient-group store listening on port %d", self._store.port)
            port = int(self._store.port)
            store_id = self._store_id
            if self._current.get(job_id) != (epoch, generation):
                self._current[job_id] = (epoch, generation)
                self._delete(
                    group_keys.job_prefix(job_id),
                    keep=group_keys.generation_prefix(job_id, epoch, generation),
                )
        return stage_pb2.ReplicaGroup(
            store_host=self._host, store_port=port, generation=generation, store_id=store_id
        )

    def forget(self, job_id: str) -> None:
        """Deletes every key of ``job_id``'s groups (the job closed)."""
        with self._lock:
            self._current.pop(job_id, None)
            self._delete(group_keys.job_prefix(job_id), keep=None)

    def num_keys(self) -> int:
        """How many keys the store holds (0 before it is started)."""
        with self._lock:
            return int(self._store.num_keys()) if self._store is not None else 0

    def _delete(self, prefix: str, *, keep: str | None) -> None:
        """Deletes the keys under ``prefix`` but not under ``keep``; best effort (a failure
        only leaves keys behind, logged). Called with the lock held."""
        if self._store is None:
            return
        try:
            for key in self._store.list_keys():
                if key.startswith(prefix) and not (keep and key.startswith(keep)):
                    self._store.delete_key(key)
        except RuntimeError as exc:  # torch's DistStoreError
            logger.warning("deleting the store keys under %s failed: %s", prefix, exc)

    def close(self) -> None:
        """Stops the store (the coordinator is stopping)."""
        with self._lock:
            self._store = None
            self._current.clear()


@dataclass(frozen=True, slots=True)
class RunReplies:
    """The replies of one run: of every stage that took part, in plan order, and per replica."""

    by_replica: list[list[stage_pb2.RunStepResponse]]
    """Each replica that took part: its stages' replies in rank order."""

    @property
    def losses(self) -> list[float]:
        """Each micro-batch's weighted loss, in the step's order (training)."""
        return [loss for replies in self.by_replica for loss in replies[-1].losses]

    @property
    def outputs(self) -> list[common_pb2.Tensor]:
        """Each micro-batch's output, in the batch's order (inference and generation)."""
        return [t for replies in self.by_replica for t in replies[-1].outputs]

    @property
    def grad_norm_sq(self) -> float:
        """The squared global gradient norm, from the first replica (after the gradient sum
        every replica holds the same gradients), summed as the links sum it (see [Note: norm
        along the links] in ``pipesvc.core.clipping``)."""
        return total_norm_sq([r.grad_norm_sq for r in self.by_replica[0]])
