"""The client's checkpoint I/O: ``Job.save`` writes a checkpoint directory from the job's
state as it streams, ``create_job(resume_from=...)`` checks one against the job it starts
and loads it into the stages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipesvc.core.config import JobConfig, config_to_dict
from pipesvc.core.plan import plan_to_dicts
from pipesvc.core.tensor_codec import named_frames, read_named_frames
from pipesvc.errors import InvalidArgumentError
from pipesvc.storage.checkpoint import (
    Manifest,
    read_layers,
    read_manifest,
    verify,
    write_checkpoint,
)
from pipesvc.storage.publish import check_target
from pipesvc.v1 import common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from pipesvc.client.job import Job


def save(job: Job, path: str | Path) -> None:
    """See ``Job.save``."""
    check_target(path)  # before the state streams
    job.refresh()
    client = job._client
    request = coordinator_pb2.GetJobStateRequest(job_id=job.id, kind=common_pb2.CHECKPOINT)
    with client._rpc_errors():
        stream = client._stub.GetState(request, timeout=client.timeout_s)
        write_checkpoint(
            path,
            read_named_frames(stream),
            job_id=job.id,
            step=job.step,
            spec=config_to_dict(job.config),
            num_layers=job.num_layers,
            plan=plan_to_dicts(job.plan),
        )


def resume_manifest(resume_from: str | Path, config: JobConfig) -> Manifest:
    """The manifest of the checkpoint a new job is to start from, checked whole (digests)
    and against the job's model, model arguments and optimizer.

    Raises:
        NotFoundError: no checkpoint there, or a file of it is missing.
        InvalidArgumentError: a malformed manifest, a file whose digest does not match, or
            a checkpoint of another model or optimizer.
    """
    manifest = read_manifest(resume_from)
    verify(resume_from, manifest)
    saved, asked = manifest.spec, config_to_dict(config)
    for key in ("model", "model_args"):
        if saved.get(key) != asked[key]:
            raise InvalidArgumentError(
                f"checkpoint {str(resume_from)!r} is of {key} {saved.get(key)!r}; "
                f"the job asks for {asked[key]!r}"
            )
    if dict(saved.get("optimizer", {})).get("name") != config.optimizer.get("name"):
        raise InvalidArgumentError(
            f"checkpoint {str(resume_from)!r} holds {saved['optimizer']['name']!r} "
            f"optimizer state; the job asks for {config.optimizer.get('name')!r}"
        )
    return manifest


def load_checkpoint(job: Job, path: Path, manifest: Manifest) -> None:
    """Streams a checkpoint's layers into the job's stages, at the checkpoint's step."""

    def requests() -> Iterator[coordinator_pb2.LoadJobStateRequest]:
        first = True
        layers = read_layers(path, manifest, 0, manifest.num_layers, check_digests=False)
        for name, tensor in layers:
            for frame in named_frames(name, tensor):
                request = coordinator_pb2.LoadJobStateRequest(job_id=job.id, frame=frame)
                if first:
                    request.step = manifest.step
                    first = False
                yield request

    job._client._call(job._client._stub.LoadState, requests())
    job.step = manifest.step
