"""Project rules: pure core free of gRPC, no code-executing loaders, fresh wire code, docs."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import pipesvc
from pipesvc import proto_build

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipesvc"
GENERATED = PACKAGE / "v1"

PURE_MODULES = sorted(
    [
        *(
            PACKAGE / f"{name}.py"
            for name in (
                "errors",
                "config",
                "partition",
                "schedule",
                "microbatch",
                "tensor_codec",
                "loss",
                "optim",
                "weights",
                "security",
                "limits",
                "plan",
                "shm",
                "shm_files",
                "shm_ring",
                "allocator",
                "action",
            )
        ),
        *(PACKAGE / "models").glob("*.py"),
        PACKAGE / "stage" / "runtime.py",
        PACKAGE / "stage" / "mailbox.py",
        PACKAGE / "stage" / "frame_wire.py",
        PACKAGE / "coordinator" / "placement.py",
        PACKAGE / "stage" / "engine.py",
        PACKAGE / "stage" / "options.py",
        PACKAGE / "stage" / "microbatch_id.py",
        PACKAGE / "stage" / "reader.py",
        PACKAGE / "stage" / "sender.py",
        PACKAGE / "stage" / "shm_handshake.py",
    ]
)
EDGE_MODULES = (
    "pipesvc.transport",
    "pipesvc.rpc_status",
    "pipesvc.client",
    "pipesvc.stage.service",
    "pipesvc.stage.links",
    "pipesvc.coordinator",
)
BANNED_MODULES = ("pickle", "cPickle", "_pickle", "marshal", "dill", "shelve")
BANNED_BUILTINS = ("eval", "exec")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, importer: str) -> Iterator[str]:
    """Every module an import statement names, ``from a import b`` giving both a and a.b."""
    package = importer.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def grpc_imports(source: str, importer: str) -> list[str]:
    bad = []
    for name in imported_modules(ast.parse(source), importer):
        top = name.split(".")[0]
        edge = any(name == m or name.startswith(f"{m}.") for m in EDGE_MODULES)
        if top == "grpc" or top.startswith("grpc_") or edge or name.endswith("_pb2_grpc"):
            bad.append(name)
    return bad


def test_import_checker_finds_violations() -> None:
    source = (
        "import grpc\nimport grpc_health.v1\nfrom pipesvc import client\n"
        "from pipesvc.coordinator.job import Job\nfrom . import service\n"
        "from pipesvc.v1 import stage_pb2_grpc\nimport os, torch\n"
        "from pipesvc.v1 import common_pb2\n"
    )
    assert grpc_imports(source, "pipesvc.stage.runtime") == [
        "grpc",
        "grpc_health.v1",
        "pipesvc.client",
        "pipesvc.coordinator.job",
        "pipesvc.coordinator.job.Job",
        "pipesvc.stage.service",
        "pipesvc.v1.stage_pb2_grpc",
    ]


@pytest.mark.parametrize("path", PURE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_modules_never_import_grpc(path: Path) -> None:
    assert path.is_file()
    assert grpc_imports(path.read_text(), module_name(path)) == []


def unsafe_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [alias.name for alias in node.names]
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else names
            found += [m for m in modules if m.split(".")[0] in BANNED_MODULES]
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                found += [f"torch.{n}" for n in names if n == "load"]
            if isinstance(node, ast.ImportFrom) and node.module == "builtins":
                found += [n for n in names if n in BANNED_BUILTINS]
        elif isinstance(node, ast.Name) and node.id in (*BANNED_BUILTINS, *BANNED_MODULES):
            found.append(node.id)
        elif isinstance(node, ast.Attribute):
            # model.eval() is torch's train/eval switch; only the builtins' eval runs code.
            builtins = isinstance(node.value, ast.Name) and node.value.id in (
                "builtins",
                "__builtins__",
            )
            if node.attr in BANNED_BUILTINS and builtins:
                found.append(f"builtins.{node.attr}")
            if (
                node.attr == "load"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                found.append("torch.load")
    return found


def test_unsafe_use_checker_finds_violations() -> None:
    source = (
        "import pickle\nfrom marshal import loads\nimport torch\nx = torch.load('f')\n"
        "eval('1')\nexec('pass')\nimport builtins\nbuiltins.eval('2')\nfrom torch import load\n"
        "import safetensors.torch\ny = safetensors.torch.load_file('f')\nmodel.eval()\n"
    )
    assert sorted(unsafe_uses(source)) == sorted(
        ["pickle", "marshal", "torch.load", "eval", "exec", "builtins.eval", "torch.load"]
    )


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_pickle_torch_load_eval_exec_or_marshal(path: Path) -> None:
    assert unsafe_uses(path.read_text()) == []


def test_public_all_is_sorted_unique_and_resolves() -> None:
    names = list(pipesvc.__all__)
    assert names == sorted(names)
    assert len(names) == len(set(names))
    missing = [name for name in names if not hasattr(pipesvc, name)]
    assert missing == []


def test_generated_wire_code_is_fresh(tmp_path: Path) -> None:
    proto_build.generate(ROOT, tmp_path)
    fresh_dir = tmp_path / "pipesvc" / "v1"
    fresh = {p.name: p.read_bytes() for p in fresh_dir.glob("*_pb2*.py")}
    committed = {p.name: p.read_bytes() for p in GENERATED.glob("*_pb2*.py")}
    expected_names = {
        f"{Path(proto).stem}_pb2{suffix}.py"
        for proto in proto_build.PROTO_FILES
        for suffix in ("", "_grpc")
    }
    assert set(fresh) == expected_names
    assert set(committed) == set(fresh), "committed generated files differ from the fresh set"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert stale == [], f"regenerate with `python -m pipesvc.proto_build`: {stale} are stale"


def test_every_proto_is_compiled() -> None:
    protos = {p.name for p in (ROOT / "protos" / "pipesvc" / "v1").glob("*.proto")}
    assert protos == set(proto_build.PROTO_FILES)


DECLARATION = re.compile(r"^\s*(rpc|service)\s+(\w+)")


@pytest.mark.parametrize(
    "proto",
    sorted((ROOT / "protos" / "pipesvc" / "v1").glob("*.proto")),
    ids=lambda p: p.name,
)
def test_every_service_and_rpc_is_commented(proto: Path) -> None:
    lines = proto.read_text().splitlines()
    uncommented = [
        f"{match.group(1)} {match.group(2)} (line {number + 1})"
        for number, line in enumerate(lines)
        if (match := DECLARATION.match(line))
        and (number == 0 or not lines[number - 1].strip().startswith("//"))
    ]
    assert uncommented == []


def readme_commands() -> list[str]:
    """The lines of README.md's first ```bash block, comments and blank lines left out."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^```(?:bash|sh|shell)\s*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block is not None, "README.md has no ```bash block"
    lines = [line.strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_test_command_is_what_ci_runs() -> None:
    assert (ROOT / "README.md").is_file(), "README.md is missing"
    ci = ROOT / ".ci" / "run"
    assert ci.is_file(), ".ci/run is missing"
    commands = readme_commands()
    assert len(commands) >= 2, f"README's first bash block has {commands}; expected two commands"
    test_command = commands[1]
    assert test_command in ci.read_text(), f"{test_command!r} is not what .ci/run runs"
