"""Writing a directory of files that a user names, deleting nothing pipesvc did not write.

[Note: saving beside] ``job.save``, ``job.save_pretrained`` and the coordinator's checkpoints
write their files into a fresh temporary directory, then publish them. A target that does not
exist yet gets the whole temporary directory renamed onto it (written beside it, so readers see
all of it or nothing). Into an existing directory the files are moved one by one (each
``os.replace`` whole), the format's entry file (manifest, index) last, as ``transformers``'
``save_pretrained`` overwrites its own files in a directory it is given; everything else there
stays. A file of the format that the new save does not rewrite (the shards of an earlier,
larger save, an index when the new save is one file) would confuse a reader, so it is deleted
only if pipesvc wrote it (its safetensors metadata or JSON metadata carries ``WRITER``);
otherwise nothing is published and the save is refused with a typed error naming the file.
The target itself must be a directory or not exist (never a file, never a link to none), and
is never removed or replaced: ``save(".")`` writes into the working directory. Temporary
directories have names no user file has (``.{name}.{random}.pipesvc-tmp``), so a failed save
removes only its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

from pipesvc.errors import FailedPreconditionError, InvalidArgumentError, PipesvcError
from pipesvc.storage.weights import read_metadata, sync_path

WRITER = {"writer": "pipesvc"}
"""Metadata in every safetensors file (and JSON index) pipesvc writes, so a later save knows
which stale files are its own to delete."""
TEMP_SUFFIX = ".pipesvc-tmp"
_MAX_JSON_BYTES = 1 << 20


def check_target(directory: str | os.PathLike[str]) -> Path:
    """The absolute path of a directory to save into: one that exists or does not exist yet.

    Raises:
        InvalidArgumentError: it exists and is not a directory (a file, or a link to none).
    """
    path = Path(os.path.abspath(directory))
    if os.path.lexists(path) and not path.is_dir():
        kind = "a link to no directory" if path.is_symlink() else "not a directory"
        raise InvalidArgumentError(
            f"cannot save into {str(path)!r}: it is {kind}; expected a directory or a path "
            "that does not exist"
        )
    return path


def temp_name_pattern(names: str) -> re.Pattern[str]:
    """Names of the temporary directories made for targets whose names match the regular
    expression ``names`` (of at most 100 characters)."""
    return re.compile(rf"\.(?:{names})\.[0-9a-f]{{16}}" + re.escape(TEMP_SUFFIX))


def _make_temp(parent: Path, name: str) -> Path:
    """A new empty directory in ``parent`` (mode 0o777 less the umask, like a plain mkdir)."""
    while True:
        path = parent / f".{name[:100]}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            path.mkdir()
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue
        return path


def written_by_pipesvc(path: Path) -> bool:
    """Whether ``path`` is a plain file that pipesvc wrote (it carries ``WRITER``)."""
    if path.is_symlink() or not path.is_file():
        return False
    if path.suffix == ".safetensors":
        try:
            return read_metadata(path).get("writer") == WRITER["writer"]
        except (PipesvcError, OSError):
            return False
    if path.suffix == ".json" and path.stat().st_size <= _MAX_JSON_BYTES:
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        metadata = value.get("metadata") if isinstance(value, dict) else None
        return isinstance(metadata, dict) and metadata.get("writer") == WRITER["writer"]
    return False


class Staging:
    """A directory's new files: written into ``path``, then published to ``target``.

    ``owned`` matches the names of the format's files (see [Note: saving beside]); ``last``
    names the entry files, published after the rest.

    Raises:
        InvalidArgumentError: the target is not a directory (``check_target``).
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        *,
        owned: re.Pattern[str],
        last: Sequence[str] = (),
    ) -> None:
        self.target = check_target(target)
        self.owned = owned
        self.last = tuple(last)
        if self.target.is_dir():  # inside it: the same file system for every rename
            self.path = _make_temp(self.target, self.target.name)
        else:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.path = _make_temp(self.target.parent, self.target.name)

    def publish(self) -> None:
        """Makes the written files durable, then visible at the target; removes the
        temporary directory.

        Raises:
            InvalidArgumentError: the target became something other than a directory.
            FailedPreconditionError: the target holds a file of the format that this save
                would leave stale and that pipesvc did not write, or a non-file where this
                save writes a file; nothing was published.
        """
        check_target(self.target)
        for file in self.path.iterdir():
            sync_path(file)
        sync_path(self.path)
        if not self.target.exists():
            # A directory created at this instant would be replaced if empty (rename(2)).
            os.rename(self.path, self.target)
            sync_path(self.target)
            sync_path(self.target.parent)
            return
        new = {file.name for file in self.path.iterdir()}
        self._refuse_unsafe(new)
        stale = [
            self.target / name
            for name in sorted(os.listdir(self.target))
            if self.owned.fullmatch(name) and name not in new
        ]
        for name in self.last:  # readers see no entry file rather than one naming new files
            if name in new:  # rewritten below anyway
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.target / name)
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        order = sorted(new, key=lambda name: (name in self.last, name))
        for name in order:
            os.replace(self.path / name, self.target / name)
        self.path.rmdir()
        sync_path(self.target)

    def _refuse_unsafe(self, new: set[str]) -> None:
        for name in sorted(new):
            path = self.target / name
            if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
                raise FailedPreconditionError(
                    f"cannot save {name!r} into {str(self.target)!r}: {str(path)!r} exists "
                    "and is not a plain file; move it away or save elsewhere"
                )
        for name in sorted(os.listdir(self.target)):
            path = self.target / name
            if self.owned.fullmatch(name) and name not in new and not written_by_pipesvc(path):
                raise FailedPreconditionError(
                    f"cannot save into {str(self.target)!r}: it holds {name!r}, which pipesvc "
                    "did not write and this save would leave stale (a reader would take it for "
                    "part of the saved model); move it away or save elsewhere"
                )

    def discard(self) -> None:
        """Removes the temporary directory (only pipesvc's files are in it)."""
        shutil.rmtree(self.path, ignore_errors=True)
