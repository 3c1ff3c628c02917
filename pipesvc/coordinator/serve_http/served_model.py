"""The models the HTTP API serves: the coordinator's open jobs, by name or id, and each one's
text: the tokenizer, chat template and end-of-sequence tokens of its model directory.

[Note: models of the HTTP API] A model of the OpenAI-compatible API is an open job: its
``name`` (``create_job(name=...)``) or, for a job without one, its id. Its text comes from the
Hugging Face directory the job's model was registered from (``tokenizer.json``, the chat
template of ``tokenizer_config.json`` or ``chat_template.jinja``, and the end-of-sequence ids of
``config.json`` / ``generation_config.json``), read by the coordinator itself: the first
stage's Describe says where it is (``export_json``'s ``source``), so the directory must be
readable on the coordinator's machine too (the same path, as in a ``LocalCluster`` or on a
shared disk). A model without one cannot turn text into tokens and is refused with a 400.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipesvc.coordinator.job import JobDriver
from pipesvc.coordinator.stage_calls import call_stage
from pipesvc.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from pipesvc.v1 import stage_pb2

Jobs = Callable[[], list[JobDriver]]


def model_name(job: JobDriver) -> str:
    """What the API calls ``job``: its name, or its id when it has none."""
    return job.config.name or job.job_id


@dataclass(frozen=True, slots=True)
class ModelText:
    """A model's tokenizer, chat template and end-of-sequence ids."""

    tokenizer: Any
    """A ``tokenizers.Tokenizer``."""
    chat_template: str | None
    special: Mapping[str, str]
    """``bos_token`` and ``eos_token`` as the template names them."""
    eos_ids: frozenset[int]
    max_positions: int
    """The most positions the model takes (0: unknown)."""

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (with the tokenizer's own added tokens when
        ``special_tokens``; a chat template writes its own)."""
        return list(self.tokenizer.encode(text, add_special_tokens=special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]]) -> str:
        """``messages`` through the chat template, ready for the assistant's reply (as
        ``transformers``' ``apply_chat_template(add_generation_prompt=True)``, in a sandbox).

        Raises:
            InvalidArgumentError: the model has no chat template, or the template refused the
                messages.
        """
        if self.chat_template is None:
            raise InvalidArgumentError(
                "this model's tokenizer has no chat template (no 'chat_template' in "
                "tokenizer_config.json, no chat_template.jinja): use /v1/completions with the "
                "prompt as text"
            )
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise FailedPreconditionError(
                "chat templates need jinja2 on the coordinator: pip install 'pipesvc[hf]'"
            ) from exc

        def raise_exception(message: str) -> None:
            raise InvalidArgumentError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as exc:
            raise InvalidArgumentError(f"the chat template failed on the messages: {exc}") from exc


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _ids(value: object) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def load_text(directory: Path, config: Mapping[str, Any]) -> ModelText:
    """The text of the Hugging Face model in ``directory`` (``config`` is its config.json).

    Raises:
        FailedPreconditionError: no ``tokenizer.json`` there.
    """
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FailedPreconditionError(
            f"the model directory {str(directory)!r} has no tokenizer.json the coordinator can "
            "read: save the tokenizer there (tokenizer.save_pretrained) so the HTTP API can "
            "turn text into tokens"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise FailedPreconditionError(
            "the HTTP API reads tokenizer.json with tokenizers on the coordinator: pip install "
            "'pipesvc[hf]'"
        ) from exc
    tokenizer = Tokenizer.from_file(str(path))
    settings = _read_json(directory / "tokenizer_config.json")
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = directory / "chat_template.jinja"
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    special = {k: _token_text(settings.get(k)) for k in ("bos_token", "eos_token")}
    eos = _ids(config.get("eos_token_id"))
    eos |= _ids(_read_json(directory / "generation_config.json").get("eos_token_id"))
    if not eos and special["eos_token"]:
        found = tokenizer.token_to_id(special["eos_token"])
        eos |= {found} if found is not None else set()
    positions = config.get("max_position_embeddings")
    return ModelText(
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        special=special,
        eos_ids=frozenset(eos),
        max_positions=positions if isinstance(positions, int) else 0,
    )


class ServedModels:
    """The open jobs as the API's models, and their text (read once per job)."""

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs
        self._texts: dict[str, ModelText] = {}
        self._lock = threading.Lock()

    def open_jobs(self) -> list[JobDriver]:
        """Every open job, oldest first."""
        return [job for job in self._jobs() if not job.closed]

    def find(self, model: str) -> JobDriver:
        """The open job named ``model``, or else with that id.

        Raises:
            NotFoundError: no open job has that name or id.
        """
        jobs = self.open_jobs()
        for job in jobs:
            if job.config.name == model:
                return job
        for job in jobs:
            if job.job_id == model:
                return job
        known = ", ".join(repr(model_name(job)) for job in jobs) or "none"
        raise NotFoundError(f"the model {model!r} does not exist; the models are: {known}")

    def text(self, job: JobDriver) -> ModelText:
        """``job``'s tokenizer and chat template (see [Note: models of the HTTP API]).

        Raises:
            FailedPreconditionError: the job's model has no directory with a tokenizer.json
                that the coordinator can read.
        """
        with self._lock:
            known = self._texts.get(job.job_id)
        if known is not None:
            return known
        reply = call_stage(
            job.group.registry,
            job.plan[0],
            lambda stub: stub.Describe,
            stage_pb2.DescribeRequest(
                model=job.config.model, model_args_json=job.config.model_args_json()
            ),
            job.group.deadlines.control_s,
        )
        export = json.loads(reply.export_json) if reply.export_json else {}
        source = export.get("source")
        if not isinstance(source, str):
            raise FailedPreconditionError(
                f"model {model_name(job)!r} ({job.config.model!r}) is not a Hugging Face model "
                "directory, so no tokenizer is known for it; the HTTP API serves models "
                "registered from a directory with a tokenizer.json"
            )
        config = export.get("config")
        text = load_text(Path(source), config if isinstance(config, dict) else {})
        with self._lock:
            self._texts[job.job_id] = text
        return text
