"""Where the gradient groups of a job with replicas keep their keys in the coordinator's store
(see [Note: gradient group] in ``pipesvc.stage.collective.replica_group``).

One prefix per job, plan epoch, generation and rank: the stages form their groups and meet
under it, and the coordinator, which alone knows which generation is current, deletes the keys
of every other generation of a job when a new one starts and all of a job's keys when it
closes (see [Note: store keys] in ``pipesvc.coordinator.replicas``). Shared here so both sides
agree on the layout.
"""

from __future__ import annotations


def job_prefix(job_id: str) -> str:
    """Every key of ``job_id``'s gradient groups starts with this."""
    return f"pipesvc/{job_id}/"


def generation_prefix(job_id: str, epoch: int, generation: int) -> str:
    """Every key of the groups of one generation of one plan epoch starts with this."""
    return f"{job_prefix(job_id)}{epoch}/{generation}/"


def group_prefix(job_id: str, epoch: int, generation: int, rank: int) -> str:
    """The prefix one rank's group forms and meets under."""
    return f"{generation_prefix(job_id, epoch, generation)}rank{rank}"
