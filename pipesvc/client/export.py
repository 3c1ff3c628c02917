"""``Job.save_pretrained``: a Hugging Face model's job written as a directory ``transformers``
(or, for LoRA adapters, ``peft``) loads (see [Note: Hugging Face export])."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipesvc.core.limits import parse_bytes
from pipesvc.errors import FailedPreconditionError
from pipesvc.storage.publish import check_target

if TYPE_CHECKING:
    from pipesvc.client.job import Job


def save_pretrained(
    job: Job,
    directory: str | Path,
    *,
    merged: bool,
    max_shard_size: str,
    dtype: str | torch.dtype | None,
) -> None:
    """See ``Job.save_pretrained``.

    Raises:
        FailedPreconditionError: not a Hugging Face model, or stale weight files.
        InvalidArgumentError: a bad ``max_shard_size`` or ``dtype``, or not a directory.
    """
    from pipesvc.models.hf_export import (
        DTYPES,
        dtype_name,
        merge_adapters,
        split_adapters,
        write_adapter,
        write_model,
    )

    export = job.model_export()
    if not export or export.get("format") != "huggingface":
        raise FailedPreconditionError(
            f"job {job.id}'s model {job.config.model!r} is not a Hugging Face model; "
            "save it with job.save(path)"
        )
    shard_bytes = parse_bytes(max_shard_size)
    chosen = dtype_name(dtype) if dtype is not None else None
    check_target(directory)  # before reading the whole state
    state, lora = job.state_dict(), export.get("lora")
    if lora and not merged:
        _, adapters = split_adapters(state)
        if chosen is not None:
            adapters = {k: v.to(DTYPES[chosen]) for k, v in adapters.items()}
        write_adapter(adapters, lora, directory, base_model=str(export.get("source", "")))
        return
    if lora:
        state = merge_adapters(state, lora)
    write_model(
        state,
        export["config"],
        directory,
        embed_key=export["embed_key"],
        head_key=export["head_key"],
        max_shard_bytes=shard_bytes,
        # stages of an older release send no "dtype": then the config's is the default
        dtype=chosen or export.get("dtype"),
        layout=export.get("layout"),
    )
