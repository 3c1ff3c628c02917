"""Text to token ids and back, for ``pipesvc generate``: a Hugging Face model's own tokenizer
(``tokenizer.json`` in its directory, read with the ``tokenizers`` package), or the character
table the demo trains the built-in ``gpt`` on."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pipesvc.errors import FailedPreconditionError, NotFoundError

if TYPE_CHECKING:
    from pipesvc.client import Job


class TextCodec(Protocol):
    """Turns text into token ids and back."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class FileTokenizer:
    """A ``tokenizer.json`` (the format ``transformers`` saves), through ``tokenizers``."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids))


def text_codec(job: Job, directory: str | Path | None = None) -> TextCodec:
    """The tokenizer for ``job``: ``directory``'s ``tokenizer.json`` when given; else the one in
    the Hugging Face model's directory (when this machine can read it); else, for the built-in
    ``gpt`` with the demo's vocabulary, the demo's characters.

    Raises:
        NotFoundError: ``directory`` has no ``tokenizer.json``.
        FailedPreconditionError: no tokenizer is known for the job's model.
    """
    if directory is not None:
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise NotFoundError(f"no tokenizer.json in {str(directory)!r}")
        return FileTokenizer(path)
    export = job.model_export()
    source = export.get("source") if export else None
    if isinstance(source, str) and (Path(source) / "tokenizer.json").is_file():
        return FileTokenizer(Path(source) / "tokenizer.json")
    if job.config.model == "gpt":
        from pipesvc.demo import CharCorpus

        corpus = CharCorpus.from_python_docs()
        if job.config.model_args.get("vocab_size") == corpus.vocab_size:
            return corpus
        vocab_size = job.config.model_args.get("vocab_size")
        if vocab_size is None:
            from pipesvc.models.gpt import gpt

            vocab_size = f"{inspect.signature(gpt).parameters['vocab_size'].default} (the default)"
        # Ids past the demo's table would decode to nothing: the rule, and how to meet it.
        raise FailedPreconditionError(
            f"the built-in gpt reads the demo's characters only with vocab_size="
            f"{corpus.vocab_size} (their count); job {job.id} has vocab_size {vocab_size}. "
            f"Create it with `pipesvc job create --model gpt --model-arg vocab_size="
            f"{corpus.vocab_size}`, or pass --tokenizer DIR, a directory with a tokenizer.json"
        )
    raise FailedPreconditionError(
        f"no tokenizer known for model {job.config.model!r} of job {job.id}; pass --tokenizer "
        "DIR, a directory with the model's tokenizer.json"
    )
