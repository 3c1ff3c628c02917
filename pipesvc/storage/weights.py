"""Model weights to and from safetensors files, with the header checked before any tensor loads.

[Note: validate before loading] Weights only ever travel as safetensors, a format that holds
data and never code. ``read_header`` parses the file's JSON header itself, against
``WeightLimits``, before the safetensors library sees the file: the header length is checked
before the header is read, and every entry's dtype, shape and byte range is checked before any
tensor is made, so a hostile file cannot make us read, parse or allocate without bound.

Usage::

    save_weights(model.state_dict(), "stage0.safetensors", metadata={"step": "100"})
    model.load_state_dict(load_weights("stage0.safetensors"))
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save, save_file

from pipesvc.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError

# The safetensors dtype names we read and write, and the torch dtype each stands for.
_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in _TO_TORCH.items()}
_PREFIX_BYTES = 8  # little-endian u64 header length
_METADATA_KEY = "__metadata__"
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
_U64_LIMIT = 1 << 64  # the format stores sizes and offsets as u64
_SHOW_CHARS = 80
_IOV_MAX = 512  # pieces per writev call (POSIX allows at least 16, Linux 1024)


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightLimits:
    """What a reader accepts in one safetensors file."""

    max_header_bytes: int = 16 << 20
    """Largest JSON header (16 MiB); checked before the header is read."""
    max_tensors: int = 100_000
    """Most tensors in one file."""
    max_total_bytes: int = 1 << 40
    """Largest sum of the tensors' byte sizes (1 TiB)."""

    def __post_init__(self) -> None:
        for field in ("max_header_bytes", "max_tensors", "max_total_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{field} ({value!r}) must be a non-negative int")


DEFAULT_WEIGHT_LIMITS = WeightLimits()


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as the header describes it; ``[begin, end)`` is relative to the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def num_bytes(self) -> int:
        """Bytes the tensor occupies in the file."""
        return self.end - self.begin


def _show(value: object) -> str:
    """``repr`` cut short, so that hostile names and shapes cannot flood a message."""
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else f"{text[: _SHOW_CHARS - 3]}..."


def _utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _prepare(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checked, detached, contiguous CPU tensors, none sharing storage with another."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not name or name == _METADATA_KEY or not _utf8(name):
            raise InvalidArgumentError(
                f"weight name {_show(name)} is invalid; expected a non-empty str of Unicode "
                f"characters (no lone surrogates) other than {_METADATA_KEY!r}"
            )
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"weight {_show(name)} is a {type(tensor).__name__}; expected a torch.Tensor"
            )
        if tensor.dtype not in _TO_NAME:
            known = ", ".join(str(d).removeprefix("torch.") for d in _TO_NAME)
            raise InvalidArgumentError(
                f"weight {_show(name)} has dtype {tensor.dtype}; expected one of {known}"
            )
        if tensor.layout != torch.strided or tensor.is_meta:
            raise InvalidArgumentError(
                f"weight {_show(name)} has layout {tensor.layout} on device {tensor.device}; "
                "expected a dense tensor with data"
            )
        tensors[name] = tensor.detach().to("cpu").contiguous()
    # safetensors refuses tensors that share storage (tied weights, views): the first keeps
    # the storage, the others are written from copies, so each loads back as its own tensor.
    seen: set[int] = set()
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        if storage.data_ptr() in seen:
            tensors[name] = tensor.clone(memory_format=torch.contiguous_format)
        else:
            seen.add(storage.data_ptr())
    return tensors


def _check_metadata_arg(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    bad = [
        k
        for k, v in metadata.items()
        if not (isinstance(k, str) and isinstance(v, str) and _utf8(k) and _utf8(v))
    ]
    if bad:
        raise InvalidArgumentError(
            f"metadata entry {_show(bad[0])} is invalid; expected str keys and str values "
            "(no lone surrogates)"
        )
    return dict(metadata)


def _create_temp(directory: str, base: str) -> str:
    """A new empty file next to the target; mode 0o666 less the umask, like a plain open."""
    while True:
        temp = os.path.join(directory, f".{base[:100]}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue
        except FileNotFoundError:
            raise NotFoundError(f"directory {directory!r} does not exist") from None
        os.close(fd)
        return temp


def sync_path(path: str | os.PathLike[str]) -> None:
    """Flushes a file, or a directory's entries, to disk."""
    if os.name != "posix" and os.path.isdir(path):  # pragma: no cover - cannot be opened
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SMALL_FILE_BYTES = 16 << 20
"""Up to this many tensor bytes, ``save_weights`` writes the file itself, the tensors' bytes
straight from their memory (a step log entry, a small shard): no copy of them in memory, and
half the system calls of safetensors' own writer, which makes and renames a second
temporary file. Larger files go through safetensors, which bounds its memory itself."""


_WRITE_ORDER = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.float32,
    torch.float64,
    torch.int64,
]
"""The dtypes in safetensors' order; it writes the last first."""


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (the machine is little-endian, as the
    format is)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    view: memoryview = flat.view(torch.uint8).numpy().data
    return view.cast("B")


def encode_weights(
    state_dict: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None
) -> list[memoryview]:
    """``state_dict`` as the bytes of a safetensors file, in pieces to write in order: the
    header, then each tensor's bytes straight from its memory (no copy of them).

    Raises:
        InvalidArgumentError: as ``save_weights``.
    """
    tensors = _prepare(state_dict)
    meta = _check_metadata_arg(metadata)
    if sys.byteorder != "little":  # pragma: no cover - the format is little-endian
        return [memoryview(save(tensors, metadata=meta))]
    return _encode(tensors, meta)


def _encode(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None) -> list[memoryview]:
    """The safetensors pieces of prepared ``tensors`` on a little-endian machine."""
    header: dict[str, object] = {} if meta is None else {_METADATA_KEY: meta}
    views = []
    offset = 0
    # Laid out as safetensors lays them out (widest dtype first, then by name), so each
    # tensor starts at a multiple of its element size and the file is the one it would write.
    order = sorted(tensors, key=lambda name: (-_WRITE_ORDER.index(tensors[name].dtype), name))
    for name in order:
        tensor = tensors[name]
        view = _raw_bytes(tensor)
        end = offset + view.nbytes
        header[name] = {
            "dtype": _TO_NAME[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        views.append(view)
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return [memoryview(struct.pack("<Q", len(text)) + text), *views]


def decode_weights(data: bytes, *, where: str) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes that this process's own disk holds (a step log entry;
    never bytes from the network: those go through ``read_header``'s checks).

    Raises:
        InvalidArgumentError: the bytes are not a safetensors file (``where`` names them).
    """
    try:
        tensors: dict[str, torch.Tensor] = load(data)
    except SafetensorError as exc:
        raise InvalidArgumentError(f"{where}: safetensors rejected the bytes: {exc}") from exc
    return tensors


def _write_small(
    temp: str,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str] | None,
    *,
    flush: bool,
) -> None:
    """Writes ``tensors`` as safetensors into the (empty) file ``temp`` (and flushes it)."""
    fd = os.open(temp, os.O_WRONLY)
    try:
        write_pieces(fd, _encode(tensors, meta))
        if flush:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_pieces(fd: int, pieces: list[memoryview]) -> None:
    """Writes ``pieces`` to ``fd`` in order, in as few system calls as the kernel allows."""
    pending = [piece for piece in pieces if piece.nbytes]
    while pending:
        written = os.writev(fd, pending[:_IOV_MAX])
        if written == 0:  # pragma: no cover - not for files; a guard against a loop
            raise OSError(f"writing to file descriptor {fd} made no progress")
        while pending and written >= pending[0].nbytes:
            written -= pending.pop(0).nbytes
        if written:
            pending[0] = pending[0][written:]


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    flush: bool = True,
) -> None:
    """Write ``state_dict`` to ``path`` as safetensors, atomically.

    The file is written beside ``path`` under a temporary name, flushed to disk and renamed over
    ``path``: a reader sees the old file or the new one, never part of one, and a failed save
    leaves the old file as it was. Tensors are saved contiguous, on the CPU, and tensors that
    share storage are each written whole. With ``flush`` False neither the file nor its rename
    is flushed yet: a caller that writes many files into a staging directory flushes them all
    once itself (``publish.Staging.publish``).

    Raises:
        InvalidArgumentError: a name is not a non-empty str, a value is not a dense tensor of a
            supported dtype, or metadata is not str to str.
        NotFoundError: the directory of ``path`` does not exist.
    """
    tensors = _prepare(state_dict)
    meta = _check_metadata_arg(metadata)
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    temp = _create_temp(directory, os.path.basename(target))
    try:
        small = sum(t.numel() * t.element_size() for t in tensors.values()) <= SMALL_FILE_BYTES
        if small and sys.byteorder == "little":
            _write_small(temp, tensors, meta, flush=flush)
        else:
            mode = os.stat(temp).st_mode & 0o777
            try:
                save_file(tensors, temp, metadata=meta)
            except SafetensorError as exc:
                raise InvalidArgumentError(
                    f"safetensors could not write {target!r}: {exc}"
                ) from exc
            # safetensors renames its own 0o600 file over ours; keep the umask-derived mode.
            os.chmod(temp, mode)
            if flush:
                sync_path(temp)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    if flush:
        sync_path(directory)


def sync_file_and_directory(path: str | os.PathLike[str]) -> None:
    """Flushes a file (or directory) and the directory entry that names it to disk."""
    target = os.path.abspath(os.fspath(path))
    sync_path(target)
    sync_path(os.path.dirname(target))


def _read_raw_header(path: str, limits: WeightLimits) -> tuple[bytes, int]:
    """The header's bytes and the data section's length; the length prefix is checked first."""
    try:
        file = open(path, "rb")  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        raise NotFoundError(f"weights file {path!r} does not exist") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"{path!r} is a directory; expected a file") from None
    with file:
        file_bytes = os.fstat(file.fileno()).st_size
        prefix = file.read(_PREFIX_BYTES)
        if len(prefix) < _PREFIX_BYTES:
            raise InvalidArgumentError(
                f"{path!r} is {file_bytes} bytes; expected at least {_PREFIX_BYTES} "
                "(the header length)"
            )
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > limits.max_header_bytes:
            raise ResourceExhaustedError(
                f"{path!r}: header length {header_bytes} exceeds max_header_bytes "
                f"({limits.max_header_bytes})"
            )
        available = file_bytes - _PREFIX_BYTES
        if header_bytes > available:
            raise InvalidArgumentError(
                f"{path!r}: header length {header_bytes} exceeds the {available} bytes after "
                f"the length prefix (file size {file_bytes})"
            )
        raw = file.read(header_bytes)
    if len(raw) != header_bytes:
        raise InvalidArgumentError(
            f"{path!r}: read {len(raw)} header bytes; expected {header_bytes} (file shrank?)"
        )
    return raw, available - header_bytes


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise InvalidArgumentError(f"duplicate key {_show(key)} in the header")
        obj[key] = value
    return obj


def _reject_constant(name: str) -> object:
    raise InvalidArgumentError(f"{name} is not allowed in the header; expected plain JSON")


def _parse_json(raw: bytes, path: str) -> dict[str, object]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            f"{path!r}: header is not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        parsed: object = json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant
        )
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{path!r}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"{path!r}: header is not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise InvalidArgumentError(
            f"{path!r}: header is a JSON {type(parsed).__name__}; expected an object"
        )
    return parsed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(name: str, value: object) -> TensorEntry:
    """One header entry, checked on its own (layout in the data section comes later)."""
    where = f"tensor {_show(name)}"
    if not name:
        raise InvalidArgumentError(f"{where}: expected a non-empty tensor name")
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            f"{where}: entry is a {type(value).__name__}; expected an object"
        )
    if sorted(value) != sorted(_ENTRY_FIELDS):
        raise InvalidArgumentError(
            f"{where}: entry has fields {_show(sorted(value))}; expected {sorted(_ENTRY_FIELDS)}"
        )
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _TO_TORCH:
        raise InvalidArgumentError(
            f"{where}: dtype {_show(dtype)} is not supported; expected one of "
            f"{', '.join(_TO_TORCH)}"
        )
    if not isinstance(shape, list):
        raise InvalidArgumentError(f"{where}: shape {_show(shape)} is not a list")
    num_elements = 1
    for index, dim in enumerate(shape):
        if not _is_int(dim) or not 0 <= dim < _U64_LIMIT:
            raise InvalidArgumentError(
                f"{where}: shape {_show(shape)} has dimension {index} = {_show(dim)}; expected "
                "a non-negative integer"
            )
        num_elements *= dim
        if num_elements >= _U64_LIMIT:  # stops early, so a long hostile shape stays cheap
            raise InvalidArgumentError(f"{where}: shape {_show(shape)} has over 2**64 elements")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and 0 <= o < _U64_LIMIT for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise InvalidArgumentError(
            f"{where}: data_offsets {_show(offsets)}; expected [begin, end] with 0 <= begin <= end"
        )
    begin, end = offsets
    expected = num_elements * _TO_TORCH[dtype].itemsize
    if end - begin != expected:
        raise InvalidArgumentError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes; dtype {dtype} "
            f"and shape {_show(shape)} need {expected}"
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_layout(entries: Mapping[str, TensorEntry], data_bytes: int) -> None:
    """The byte ranges tile the data section exactly, as the format requires."""
    covered, last = 0, ""
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        where = f"tensor {_show(name)}: data_offsets [{entry.begin}, {entry.end}]"
        if entry.end > data_bytes:
            raise InvalidArgumentError(f"{where} run past the data section of {data_bytes} bytes")
        if entry.begin < covered:
            raise InvalidArgumentError(
                f"{where} overlap tensor {_show(last)}, which ends at {covered}"
            )
        if entry.begin > covered:
            raise InvalidArgumentError(
                f"{where} leave a gap after byte {covered}; expected begin == {covered}"
            )
        covered, last = entry.end, name
    if covered != data_bytes:
        raise InvalidArgumentError(
            f"tensors cover {covered} bytes of the {data_bytes}-byte data section; expected all"
        )


def _check_metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidArgumentError(
            f"{_METADATA_KEY} is {_show(value)}; expected an object of str to str"
        )
    return dict(value)


def _read(
    path: str | os.PathLike[str], limits: WeightLimits
) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    where = os.fspath(path)
    raw, data_bytes = _read_raw_header(where, limits)
    header = _parse_json(raw, where)
    try:
        metadata = _check_metadata(header.pop(_METADATA_KEY, None))
        if len(header) > limits.max_tensors:
            raise ResourceExhaustedError(
                f"header lists {len(header)} tensors; max_tensors is {limits.max_tensors}"
            )
        entries: dict[str, TensorEntry] = {}
        total_bytes = 0
        for name, value in header.items():
            entries[name] = entry = _check_entry(name, value)
            total_bytes += entry.num_bytes
            if total_bytes > limits.max_total_bytes:
                raise ResourceExhaustedError(
                    f"tensors hold over {total_bytes} bytes; max_total_bytes is "
                    f"{limits.max_total_bytes}"
                )
        _check_layout(entries, data_bytes)
    except (InvalidArgumentError, ResourceExhaustedError) as exc:
        raise type(exc)(f"{where!r}: {exc}") from None
    return entries, metadata


def read_header(
    path: str | os.PathLike[str], limits: WeightLimits = DEFAULT_WEIGHT_LIMITS
) -> dict[str, TensorEntry]:
    """Each tensor in a safetensors file as its header describes it, checked against ``limits``.

    Reads only the 8-byte length and the header, never tensor data. See
    [Note: validate before loading].

    Raises:
        NotFoundError: ``path`` does not exist.
        InvalidArgumentError: the header is malformed (not a JSON object, duplicate keys, an
            unknown dtype, a bad shape, byte ranges that do not match the shape, overlap, leave
            gaps or run past the file).
        ResourceExhaustedError: the header, tensor count or total size is over ``limits``.
    """
    return _read(path, limits)[0]


def read_metadata(
    path: str | os.PathLike[str], limits: WeightLimits = DEFAULT_WEIGHT_LIMITS
) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (empty if it has none), after the same checks.

    Raises:
        NotFoundError, InvalidArgumentError, ResourceExhaustedError: as ``read_header``.
    """
    return _read(path, limits)[1]


def read_tensors(
    path: str | os.PathLike[str],
    names: Iterable[str],
    *,
    limits: WeightLimits = DEFAULT_WEIGHT_LIMITS,
) -> dict[str, torch.Tensor]:
    """Only the named tensors of a safetensors file, each read from its own byte range.

    The header is checked first (see [Note: validate before loading]); then each tensor is read
    straight into its own new CPU tensor, so memory grows by the named tensors alone, never by
    the file: a stage reads its layers out of a checkpoint far larger than its memory.

    Raises:
        NotFoundError, InvalidArgumentError, ResourceExhaustedError: as ``read_header``.
        NotFoundError: a name is not in the file.
        InvalidArgumentError: the file is shorter than its header says (changed under us).
    """
    where = os.fspath(path)
    raw, _ = _read_raw_header(where, limits)
    entries = read_header(where, limits)
    wanted = list(dict.fromkeys(names))
    if missing := [n for n in wanted if n not in entries]:
        raise NotFoundError(f"{where!r} holds no tensor {missing[0]!r} ({len(missing)} missing)")
    data_start = _PREFIX_BYTES + len(raw)
    tensors: dict[str, torch.Tensor] = {}
    with open(where, "rb", buffering=0) as file:
        for name in wanted:
            entry = entries[name]
            tensor = torch.empty(entry.shape, dtype=_TO_TORCH[entry.dtype])
            buffer = tensor.view(-1).view(torch.uint8).numpy()
            view = memoryview(buffer.data) if tensor.numel() else None
            file.seek(data_start + entry.begin)
            done = 0
            while view is not None and done < entry.num_bytes:  # a read returns at most ~2 GiB
                got = file.readinto(view[done:])
                if not got:
                    break
                done += got
            if done != entry.num_bytes:
                raise InvalidArgumentError(
                    f"{where!r}: tensor {name!r} needs {entry.num_bytes} bytes at offset "
                    f"{data_start + entry.begin}; the file gave {done} (was it truncated?)"
                )
            tensors[name] = tensor
    return tensors


def load_weights(
    path: str | os.PathLike[str],
    *,
    limits: WeightLimits = DEFAULT_WEIGHT_LIMITS,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, on ``device``, after ``read_header`` accepts it.

    Raises:
        NotFoundError, InvalidArgumentError, ResourceExhaustedError: as ``read_header``.
        InvalidArgumentError: ``device`` is not a device name, or the file changed under us
            and the loaded tensors no longer match the checked header.
    """
    entries = read_header(path, limits)
    where = os.fspath(path)
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"device {device!r} is not a torch device: {exc}") from None
    try:
        loaded: dict[str, torch.Tensor] = load_file(where, device=str(target))
    except FileNotFoundError:
        raise NotFoundError(f"weights file {where!r} does not exist") from None
    except SafetensorError as exc:
        raise InvalidArgumentError(f"{where!r}: safetensors rejected the file: {exc}") from exc
    found = {name: (_TO_NAME.get(t.dtype), tuple(t.shape)) for name, t in loaded.items()}
    wanted = {name: (e.dtype, e.shape) for name, e in entries.items()}
    if found != wanted:
        raise InvalidArgumentError(
            f"{where!r}: the loaded tensors do not match the checked header; was the file "
            "replaced while it was loading?"
        )
    return loaded
