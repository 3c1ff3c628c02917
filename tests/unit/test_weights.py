"""Unit tests for weight files: round trips, atomic saves, and hostile files rejected early."""

from __future__ import annotations

import ast
import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import pipesvc.storage.weights as weights_module
from pipesvc.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from pipesvc.storage.weights import (
    TensorEntry,
    WeightLimits,
    load_weights,
    read_header,
    read_metadata,
    save_weights,
)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in memory order, so that equality is bit-for-bit (NaN, -0.0 too)."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert got.device.type == "cpu", name
        assert raw_bytes(got) == raw_bytes(want), name


def mixed_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    specials = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-30, 3.5])
    return {
        "f64": torch.randn(3, 4, generator=gen, dtype=torch.float64),
        "f32": torch.cat([specials, torch.randn(6, generator=gen)]).reshape(2, 6),
        "f16": torch.randn(5, generator=gen).half(),
        "bf16": torch.cat([specials, torch.randn(3, generator=gen)]).bfloat16(),
        "i64": torch.tensor([-(2**63), -1, 0, 2**63 - 1], dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (7,), generator=gen, dtype=torch.int32),
        "i16": torch.tensor([-32768, -1, 0, 32767], dtype=torch.int16),
        "i8": torch.tensor([[-128, 0], [1, 127]], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (3, 5), generator=gen).bool(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "block.0.weight": torch.randn(2, 3, generator=gen),
    }


# ---- round trips ---------------------------------------------------------------------------


def test_round_trip_of_mixed_dtypes_is_bit_for_bit(tmp_path: Path) -> None:
    state = mixed_state()
    path = tmp_path / "w.safetensors"
    save_weights(state, path)
    assert_same(state, load_weights(path))


def test_read_header_describes_saved_tensors(tmp_path: Path) -> None:
    state = mixed_state()
    path = tmp_path / "w.safetensors"
    save_weights(state, str(path))
    header = read_header(path)
    assert set(header) == set(state)
    assert header["f32"].dtype == "F32"
    assert header["f32"].shape == (2, 6)
    assert header["f32"].num_bytes == 48
    assert header["bool"].dtype == "BOOL"
    assert header["scalar"].shape == ()
    assert header["empty"] == TensorEntry(
        "F32", (0, 3), header["empty"].begin, header["empty"].begin
    )
    assert sum(e.num_bytes for e in header.values()) == sum(
        t.numel() * t.element_size() for t in state.values()
    )


def test_non_contiguous_and_grad_tensors_save_as_their_values(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    param = torch.nn.Parameter(torch.ones(2, 2))
    state = {"transposed": base.t(), "strided": base[:, ::2], "param": param}
    path = tmp_path / "w.safetensors"
    save_weights(state, path)
    loaded = load_weights(path)
    assert_same({k: v.detach() for k, v in state.items()}, loaded)
    assert not loaded["param"].requires_grad


def test_tensors_sharing_storage_save_and_load_independently(tmp_path: Path) -> None:
    base = torch.arange(10, dtype=torch.float32)
    state = {
        "base": base,
        "view": base[2:6],
        "reshaped": base.view(2, 5),
        "tied": base,
    }
    path = tmp_path / "w.safetensors"
    save_weights(state, path)
    loaded = load_weights(path)
    assert_same({k: v.clone() for k, v in state.items()}, loaded)
    loaded["base"][0] = 99.0
    assert loaded["tied"][0].item() == 0.0
    assert loaded["reshaped"][0, 0].item() == 0.0
    assert base[0].item() == 0.0  # the caller's tensors were not touched


def test_metadata_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    metadata = {"step": "100", "model": "gpt-tiny", "note": "ünïcode"}
    save_weights({"w": torch.ones(2)}, path, metadata=metadata)
    assert read_metadata(path) == metadata
    assert "__metadata__" not in read_header(path)
    assert set(load_weights(path)) == {"w"}


def test_metadata_is_empty_when_none_was_saved(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights({"w": torch.ones(2)}, path)
    assert read_metadata(path) == {}


def test_empty_state_dict_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights({}, path)
    assert load_weights(path) == {}


# ---- save arguments and atomicity ----------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"": torch.ones(1)}, "weight name ''"),
        ({3: torch.ones(1)}, "weight name 3"),
        ({"__metadata__": torch.ones(1)}, "__metadata__"),
        ({"w": [1.0, 2.0]}, "weight 'w' is a list"),
        ({"w": torch.ones(2, dtype=torch.complex64)}, "dtype torch.complex64"),
        ({"w": torch.ones(2).to_sparse()}, "layout torch.sparse_coo"),
        ({"w": torch.empty(2, device="meta")}, "device meta"),
    ],
)
def test_save_rejects_bad_entries(tmp_path: Path, state: dict[object, object], match: str) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(InvalidArgumentError, match=re.escape(match)):
        save_weights(state, path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_save_rejects_non_str_metadata(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="'step'"):
        save_weights({"w": torch.ones(1)}, tmp_path / "w", metadata={"step": 3})  # type: ignore[dict-item]


def test_save_into_missing_directory_is_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(NotFoundError, match=re.escape(str(missing))):
        save_weights({"w": torch.ones(1)}, missing / "w.safetensors")


def test_failed_save_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights({"w": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(InvalidArgumentError):
        save_weights({"w": torch.zeros(3), 7: torch.zeros(1)}, path)  # type: ignore[dict-item]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


@pytest.mark.parametrize("writer", ["small", "safetensors"])
def test_save_failing_mid_write_leaves_old_file_and_no_temp(
    writer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either writer: ours for small files (``SMALL_FILE_BYTES``), safetensors' for large."""
    path = tmp_path / "w.safetensors"
    save_weights({"w": torch.ones(3)}, path)
    before = path.read_bytes()
    written: list[str] = []

    def broken_save(tensors: object, filename: str, metadata: object = None) -> None:
        written.append(filename)
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    def broken_write(fd: int, pieces: list[memoryview]) -> None:
        written.append(os.readlink(f"/proc/self/fd/{fd}"))
        os.write(fd, pieces[0][: len(pieces[0]) // 2])
        raise OSError(28, "No space left on device")

    if writer == "small":
        monkeypatch.setattr(weights_module, "write_pieces", broken_write)
    else:
        monkeypatch.setattr(weights_module, "SMALL_FILE_BYTES", 0)
        monkeypatch.setattr(weights_module, "save_file", broken_save)
    with pytest.raises(OSError, match="No space"):
        save_weights({"w": torch.zeros(3)}, path)
    assert len(written) == 1
    assert Path(written[0]).parent == tmp_path  # the temp file was beside the target
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


@pytest.mark.parametrize("small_file_bytes", [1 << 30, 0])
def test_both_writers_write_files_safetensors_reads_alike(
    small_file_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ours (small files) and safetensors' writer: every dtype, empty and 0-d tensors and a
    view into a larger tensor read back equal, by safetensors itself and by ``load_weights``,
    with the metadata, the mode a plain open would give and the data 8-byte aligned."""
    monkeypatch.setattr(weights_module, "SMALL_FILE_BYTES", small_file_bytes)
    base = torch.randn(6, 5)
    state = {
        "view": base[2:4],
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "bf16": torch.randn(3, 7).to(torch.bfloat16),
        "half": torch.randn(5).half(),
        "ints": torch.arange(-4, 5, dtype=torch.int64),
        "int32": torch.arange(9, dtype=torch.int32),
        "int16": torch.arange(3, dtype=torch.int16),
        "int8": torch.arange(-3, 3, dtype=torch.int8),
        "bytes": torch.arange(7, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
    }
    path = tmp_path / "w.safetensors"
    save_weights(state, path, metadata={"k": "v"})
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    header_bytes = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_bytes % 8 == 0
    with safe_open(str(path), framework="pt") as theirs:
        assert theirs.metadata() == {"k": "v"}
        assert set(theirs.keys()) == set(state)
        for name, tensor in state.items():
            assert torch.equal(theirs.get_tensor(name), tensor), name
    ours = load_weights(path)
    assert all(torch.equal(ours[k], state[k]) and ours[k].dtype == state[k].dtype for k in state)
    # The very file safetensors writes: each tensor aligned to its element size.
    reference = tmp_path / "reference.safetensors"
    weights_module.save_file(
        {k: v.contiguous() for k, v in state.items()}, str(reference), metadata={"k": "v"}
    )
    assert path.read_bytes() == reference.read_bytes()
    for name, entry in read_header(path).items():
        assert entry.begin % state[name].element_size() == 0, name


@pytest.mark.parametrize(
    ("state", "metadata"),
    [({"a\ud800": torch.ones(2)}, None), ({"a": torch.ones(2)}, {"k": "\udfff"})],
)
def test_names_that_cannot_be_utf8_are_refused_before_anything_is_written(
    state: dict[str, torch.Tensor], metadata: dict[str, str] | None, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgumentError, match="lone surrogates"):
        save_weights(state, tmp_path / "w.safetensors", metadata=metadata)
    assert list(tmp_path.iterdir()) == []


def test_successful_overwrite_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights({"w": torch.ones(3)}, path)
    save_weights({"v": torch.full((2,), 7.0)}, path)
    assert_same({"v": torch.full((2,), 7.0)}, load_weights(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_saved_file_mode_follows_umask(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    old = os.umask(0o022)
    try:
        save_weights({"w": torch.ones(1)}, path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


# ---- missing files and limits --------------------------------------------------------------


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    path = tmp_path / "absent.safetensors"
    for call in (load_weights, read_header, read_metadata):
        with pytest.raises(NotFoundError, match=re.escape(str(path))):
            call(path)


def test_directory_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        read_header(tmp_path)


def test_bad_device_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights({"w": torch.ones(1)}, path)
    with pytest.raises(InvalidArgumentError, match="not-a-device"):
        load_weights(path, device="not-a-device")


@pytest.mark.parametrize("field", ["max_header_bytes", "max_tensors", "max_total_bytes"])
def test_limits_reject_negative_values(field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"{field} \(-1\)"):
        WeightLimits(**{field: -1})


def test_limits_are_frozen() -> None:
    limits = WeightLimits()
    with pytest.raises(AttributeError):
        limits.max_tensors = 1  # type: ignore[misc]


# ---- hostile files -------------------------------------------------------------------------


def write_file(path: Path, header: bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    """A file as safetensors lays it out: u64 LE header length, header, data."""
    prefix = struct.pack("<Q", len(header) if length is None else length)
    path.write_bytes(prefix + header + data)
    return path


def write_json(path: Path, header: object, data: bytes = b"") -> Path:
    return write_file(path, json.dumps(header).encode(), data)


def entry(dtype: str, shape: list[object], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.fixture
def no_library_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if a hostile file ever reaches the safetensors loader."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_file was called on a file read_header should have rejected")

    monkeypatch.setattr(weights_module, "load_file", refuse)


def test_hand_built_valid_file_loads(tmp_path: Path) -> None:
    data = struct.pack("<2f", 1.5, -2.0) + bytes([1, 0, 1])
    header = {
        "__metadata__": {"k": "v"},
        "a": entry("F32", [2], 0, 8),
        "b": entry("BOOL", [3], 8, 11),
    }
    path = write_json(tmp_path / "f", header, data)
    loaded = load_weights(path)
    assert loaded["a"].tolist() == [1.5, -2.0]
    assert loaded["b"].tolist() == [True, False, True]
    assert read_metadata(path) == {"k": "v"}


def test_header_length_beyond_file_is_invalid(tmp_path: Path, no_library_load: None) -> None:
    path = write_file(tmp_path / "f", b"{}", length=100)
    with pytest.raises(InvalidArgumentError, match=r"header length 100 exceeds the 2 bytes"):
        load_weights(path)


def test_header_length_over_limit_is_rejected_before_reading(
    tmp_path: Path, no_library_load: None
) -> None:
    path = tmp_path / "f"
    path.write_bytes(struct.pack("<Q", 2**60))
    with pytest.raises(ResourceExhaustedError, match=rf"{2**60} exceeds max_header_bytes"):
        load_weights(path)


def test_header_over_small_limit_is_rejected(tmp_path: Path) -> None:
    header = {"a": entry("U8", [4], 0, 4), "pad": entry("U8", [0], 4, 4)}
    path = write_json(tmp_path / "f", header, b"\0" * 4)
    size = len(json.dumps(header))
    assert read_header(path, WeightLimits(max_header_bytes=size)) is not None
    with pytest.raises(ResourceExhaustedError, match=rf"length {size} .*\({size - 1}\)"):
        read_header(path, WeightLimits(max_header_bytes=size - 1))


def test_file_shorter_than_length_prefix_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(InvalidArgumentError, match="is 3 bytes; expected at least 8"):
        read_header(path)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "JSON list; expected an object"),
        (b'"text"', "JSON str; expected an object"),
        (b'{"a": NaN}', "NaN is not allowed"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    ],
    ids=["garbage", "empty", "not-utf8", "array", "string", "nan", "deep"],
)
def test_malformed_header_is_invalid(
    tmp_path: Path, no_library_load: None, header: bytes, match: str
) -> None:
    path = write_file(tmp_path / "f", header)
    with pytest.raises(InvalidArgumentError, match=match):
        load_weights(path)


def test_duplicate_tensor_keys_are_invalid(tmp_path: Path, no_library_load: None) -> None:
    one = json.dumps(entry("U8", [2], 0, 2))
    header = f'{{"w": {one}, "w": {one}}}'.encode()
    path = write_file(tmp_path / "f", header, b"\0\0")
    with pytest.raises(InvalidArgumentError, match="duplicate key 'w'"):
        load_weights(path)


def test_duplicate_fields_in_an_entry_are_invalid(tmp_path: Path) -> None:
    header = b'{"w": {"dtype": "U8", "dtype": "F32", "shape": [1], "data_offsets": [0, 1]}}'
    path = write_file(tmp_path / "f", header, b"\0")
    with pytest.raises(InvalidArgumentError, match="duplicate key 'dtype'"):
        read_header(path)


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"w": entry("Q7", [1], 0, 1)}, 1, "dtype 'Q7' is not supported; expected one of F64"),
        ({"w": entry("C64", [1], 0, 8)}, 8, "dtype 'C64' is not supported"),
        ({"w": entry("F32", [2, -1], 0, 0)}, 0, r"dimension 1 = -1; expected a non-negative"),
        ({"w": entry("F32", [2.0], 0, 8)}, 8, r"dimension 0 = 2\.0"),
        ({"w": entry("F32", [True], 0, 4)}, 4, r"dimension 0 = True"),
        ({"w": entry("F32", [2**40, 2**40], 0, 0)}, 0, r"over 2\*\*64 elements"),
        ({"w": entry("F32", [3], 0, 8)}, 8, r"\[0, 8\] hold 8 bytes; dtype F32 .* need 12"),
        ({"w": entry("F32", [2], 8, 0)}, 8, r"data_offsets \[8, 0\]; expected"),
        ({"w": entry("F32", [2], -8, 0)}, 8, r"data_offsets \[-8, 0\]"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, 4, r"\[0, 4, 8\]"),
        ({"w": [1, 2, 3]}, 0, r"tensor 'w': entry is a list; expected an object"),
        ({"w": {"dtype": "F32", "shape": [1]}}, 4, r"fields \['dtype', 'shape'\]"),
        ({"w": {**entry("U8", [1], 0, 1), "x": 1}}, 1, r"fields .*'x'"),
        ({"": entry("U8", [1], 0, 1)}, 1, "non-empty tensor name"),
        ({"__metadata__": {"k": 1}}, 0, r"__metadata__ is \{'k': 1\}; expected"),
        ({"__metadata__": "v"}, 0, r"__metadata__ is 'v'"),
    ],
)
def test_bad_entry_is_invalid(
    tmp_path: Path, no_library_load: None, header: object, data: int, match: str
) -> None:
    path = write_json(tmp_path / "f", header, b"\0" * data)
    with pytest.raises(InvalidArgumentError, match=match):
        load_weights(path)


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        (
            {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)},
            12,
            r"tensor 'b': data_offsets \[4, 12\] overlap tensor 'a', which ends at 8",
        ),
        (
            {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 8, 16)},
            12,
            r"tensor 'b': data_offsets \[8, 16\] run past the data section of 12 bytes",
        ),
        (
            {"a": entry("F32", [2], 4, 12)},
            12,
            r"\[4, 12\] leave a gap after byte 0",
        ),
        (
            {"a": entry("F32", [1], 0, 4)},
            8,
            r"cover 4 bytes of the 8-byte data section",
        ),
    ],
    ids=["overlap", "beyond", "gap", "trailing"],
)
def test_bad_layout_is_invalid(
    tmp_path: Path, no_library_load: None, header: object, data: int, match: str
) -> None:
    path = write_json(tmp_path / "f", header, b"\0" * data)
    with pytest.raises(InvalidArgumentError, match=match):
        load_weights(path)


def test_too_many_tensors_over_small_limit(tmp_path: Path, no_library_load: None) -> None:
    header = {f"t{i}": entry("U8", [1], i, i + 1) for i in range(3)}
    path = write_json(tmp_path / "f", header, b"\0" * 3)
    assert len(read_header(path, WeightLimits(max_tensors=3))) == 3
    with pytest.raises(ResourceExhaustedError, match=r"lists 3 tensors; max_tensors is 2"):
        load_weights(path, limits=WeightLimits(max_tensors=2))


def test_total_bytes_over_limit(tmp_path: Path, no_library_load: None) -> None:
    header = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 8, 16)}
    path = write_json(tmp_path / "f", header, b"\0" * 16)
    assert len(read_header(path, WeightLimits(max_total_bytes=16))) == 2
    with pytest.raises(ResourceExhaustedError, match=r"over 16 bytes; max_total_bytes is 15"):
        load_weights(path, limits=WeightLimits(max_total_bytes=15))


def test_huge_claimed_tensor_is_rejected_without_allocating(
    tmp_path: Path, no_library_load: None
) -> None:
    size = 1 << 50
    header = {"w": entry("U8", [size], 0, size)}
    path = write_json(tmp_path / "f", header, b"\0" * 8)
    with pytest.raises(ResourceExhaustedError, match=rf"over {size} bytes"):
        load_weights(path)
    with pytest.raises(InvalidArgumentError, match=rf"\[0, {size}\] run past .* of 8 bytes"):
        load_weights(path, limits=WeightLimits(max_total_bytes=size))


def test_long_hostile_names_are_shortened_in_messages(tmp_path: Path) -> None:
    name = "x" * 10_000
    path = write_json(tmp_path / "f", {name: entry("Q7", [1], 0, 1)}, b"\0")
    with pytest.raises(InvalidArgumentError) as info:
        read_header(path)
    assert "Q7" in str(info.value)
    assert len(str(info.value)) < 500


def test_file_changed_after_header_check_is_invalid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.safetensors"
    save_weights({"w": torch.ones(2)}, path)
    monkeypatch.setattr(weights_module, "load_file", lambda *a, **k: {"w": torch.ones(3)})
    with pytest.raises(InvalidArgumentError, match="replaced while it was loading"):
        load_weights(path)


# ---- source rules --------------------------------------------------------------------------


def test_source_has_no_code_executing_loader_and_no_grpc() -> None:
    source = Path(weights_module.__file__).read_text()
    assert "pickle" not in source.lower()
    assert re.search(r"torch\s*\.\s*load\b", source) is None
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "grpc" not in imported
    assert not any(name.startswith("grpc") for name in imported)
    assert {"safetensors", "torch"} <= imported


@pytest.mark.parametrize("small_file_bytes", [1 << 30, 0])
def test_flush_false_leaves_flushing_to_the_caller(
    small_file_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file saved into a staging directory is flushed once, by the publish, not also by
    ``save_weights`` (either writer); a plain save flushes the file and its directory."""
    monkeypatch.setattr(weights_module, "SMALL_FILE_BYTES", small_file_bytes)
    flushed: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_weights({"w": torch.ones(3)}, tmp_path / "plain.safetensors")
    assert len(flushed) == 2 and flushed[1] == str(tmp_path)  # the file (as its temp), the dir
    flushed.clear()
    save_weights({"w": torch.ones(3)}, tmp_path / "staged.safetensors", flush=False)
    assert flushed == []
    assert torch.equal(load_weights(tmp_path / "staged.safetensors")["w"], torch.ones(3))


@pytest.mark.parametrize("most_per_call", [None, 7])
def test_write_pieces_writes_every_piece_in_order(
    most_per_call: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More pieces than one ``writev`` takes, empty ones among them; with ``most_per_call``,
    each call writes only that many bytes, as a kernel may."""
    pieces = [memoryview(bytes([i % 251]) * (i % 5)) for i in range(1500)]
    if most_per_call is not None:
        real = os.writev

        def short(fd: int, buffers: list[memoryview]) -> int:
            return real(fd, [b"".join(bytes(b) for b in buffers)[:most_per_call]])

        monkeypatch.setattr(os, "writev", short)
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        weights_module.write_pieces(fd, pieces)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(bytes(p) for p in pieces)
