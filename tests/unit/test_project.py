"""Project rules: pure core free of gRPC, no code-executing loaders, fresh wire code, docs."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import pipesvc
from pipesvc.wire import proto_build

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipesvc"
GENERATED = PACKAGE / "v1"

LAYERS: dict[str, frozenset[str]] = {
    # A folder (or top-level module) of the package, and what it may import from the package.
    "errors": frozenset(),
    "v1": frozenset(),
    "name_registry": frozenset({"errors"}),
    "models": frozenset({"errors", "name_registry", "storage", "core"}),
    "storage": frozenset({"errors"}),
    "observe": frozenset({"errors"}),
    "core": frozenset({"errors", "name_registry", "v1"}),  # neither models nor gRPC
    "wire": frozenset({"errors", "name_registry", "v1", "core"}),
    "stage": frozenset(
        {"errors", "name_registry", "v1", "core", "models", "storage", "observe", "wire"}
    ),
    "coordinator": frozenset(
        {"errors", "name_registry", "v1", "core", "models", "storage", "observe", "wire"}
    ),
    "client": frozenset(
        {"errors", "name_registry", "v1", "core", "models", "storage", "observe", "wire"}
    ),
}
"""The rest (``cli``, ``local_cluster``, ``demo``, ``tokenizer``, ``__init__``) is the
application on top."""
PURE_LAYERS = ("errors", "name_registry", "models", "storage", "observe", "core")
"""Folders that must never reach gRPC, directly or through another module."""
STAGE_FOLDERS: dict[str, frozenset[str]] = {
    # A folder of ``pipesvc.stage``, and which of the stage's folders it may import.
    "compute": frozenset({"dataplane", "collective"}),  # the step engine, runtime, caches
    "dataplane": frozenset(),  # mailboxes, frames, shared memory, a link's two sides
    "collective": frozenset(),  # the gradient group of replicas (gloo)
    "net": frozenset({"compute", "dataplane"}),  # the gRPC streams between stages
}
"""The stage server's modules at the top of ``pipesvc.stage`` (server, service, assignment,
control, options) are its RPC edge, over all three."""
PURE_STAGE_FOLDERS = ("compute", "dataplane", "collective")
"""Stage folders that must never reach gRPC, directly or through another module."""
PURE_IN_SERVERS = (
    "pipesvc.stage.options",
    "pipesvc.coordinator.session",
    "pipesvc.coordinator.job_counters",
    "pipesvc.coordinator.job_storage",
    "pipesvc.coordinator.ledger",
    "pipesvc.coordinator.step_log",
)
"""The coordinator's pure planning and state, and the stage's options: testable in one process
without a server."""
BANNED_MODULES = ("pickle", "cPickle", "_pickle", "marshal", "dill", "shelve")
BANNED_BUILTINS = ("eval", "exec")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """``pipesvc.stage.compute.engine`` -> ``stage``; ``pipesvc.client`` -> ``client``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


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


def reaches_grpc(sources: dict[str, str]) -> dict[str, list[str]]:
    """For each module, the imports through which it reaches gRPC (directly or transitively).

    A module reaches gRPC if it imports grpc, a ``*_pb2_grpc`` module, or a module of
    ``sources`` that reaches gRPC.
    """
    imports = {m: set(imported_modules(ast.parse(s), m)) for m, s in sources.items()}
    bound: dict[str, list[str]] = {}
    changed = True
    while changed:
        changed = False
        for module, names in imports.items():
            via = sorted(
                n
                for n in names
                if n.split(".")[0] == "grpc"
                or n.split(".")[0].startswith("grpc_")
                or n.endswith("_pb2_grpc")
                or n in bound
            )
            if via and bound.get(module) != via:
                bound[module] = via
                changed = True
    return bound


def package_sources() -> dict[str, str]:
    return {
        module_name(p): p.read_text() for p in PACKAGE.rglob("*.py") if GENERATED not in p.parents
    }


def test_grpc_reach_is_transitive() -> None:
    sources = {
        "pkg.wire": "import grpc\n",
        "pkg.edge": "from pkg import wire\n",
        "pkg.core": "import os\nfrom pkg.v1 import common_pb2\n",
        "pkg.stub": "from pkg.v1 import stage_pb2_grpc\n",
        "pkg.far": "from pkg.edge import thing\nfrom pkg.core import x\n",
    }
    bound = reaches_grpc(sources)
    assert sorted(bound) == ["pkg.edge", "pkg.far", "pkg.stub", "pkg.wire"]
    assert bound["pkg.far"] == ["pkg.edge"]
    assert bound["pkg.stub"] == ["pkg.v1.stage_pb2_grpc"]


def stage_folder(module: str) -> str:
    """``pipesvc.stage.compute.engine`` -> ``compute``; ``pipesvc.stage.service`` -> ``""``."""
    parts = module.split(".")
    in_folder = len(parts) > 2 and parts[1] == "stage" and parts[2] in STAGE_FOLDERS
    return parts[2] if in_folder else ""


def test_pure_modules_never_reach_grpc() -> None:
    sources = package_sources()
    assert [m for m in PURE_IN_SERVERS if m not in sources] == []
    pure = [m for m in sources if layer_of(m) in PURE_LAYERS] + list(PURE_IN_SERVERS)
    pure += [m for m in sources if stage_folder(m) in PURE_STAGE_FOLDERS]
    assert {stage_folder(m) for m in pure} >= set(PURE_STAGE_FOLDERS)
    bound = reaches_grpc(sources)
    assert {m: bound[m] for m in sorted(pure) if m in bound} == {}


def test_every_folder_imports_only_its_lower_layers() -> None:
    wrong = {}
    for module, source in package_sources().items():
        allowed = LAYERS.get(layer_of(module))
        if allowed is None:
            continue
        layers = {
            layer_of(name)
            for name in imported_modules(ast.parse(source), module)
            if name.startswith("pipesvc.")
        }
        if extra := sorted(layers - allowed - {layer_of(module)}):
            wrong[module] = extra
    assert wrong == {}


def test_each_stage_folder_imports_only_the_folders_below_it() -> None:
    wrong = {}
    for module, source in package_sources().items():
        folder = stage_folder(module)
        if not folder:
            continue
        reached = {
            stage_folder(name) or name
            for name in imported_modules(ast.parse(source), module)
            if name.startswith("pipesvc.stage.")
        }
        if extra := sorted(reached - STAGE_FOLDERS[folder] - {folder}):
            wrong[module] = extra
    assert wrong == {}


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
    fresh = {p.name: p.read_bytes() for p in fresh_dir.glob("*_pb2*.py*")}
    committed = {p.name: p.read_bytes() for p in GENERATED.glob("*_pb2*.py*")}
    expected_names = {
        f"{Path(proto).stem}_pb2{suffix}{ext}"
        for proto in proto_build.PROTO_FILES
        for suffix in ("", "_grpc")
        for ext in (".py", ".pyi")  # the code and its typed stubs for mypy
    }
    assert set(fresh) == expected_names
    assert set(committed) == set(fresh), "committed generated files differ from the fresh set"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert stale == [], f"regenerate with `python -m pipesvc.wire.proto_build`: {stale} are stale"


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


NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def note_name(found: re.Match[str]) -> str:
    """The name of a ``[Note: ...]`` match, wrapped over comment lines or not."""
    return " ".join(re.sub(r"\n\s*(#|//)?", " ", found.group(1)).split())


def notes_in(text: str) -> Iterator[tuple[str, bool]]:
    """Each ``[Note: name]`` in ``text`` and whether it is the note itself, not a reference to
    it. A note opens a paragraph (a blank line, a comment line or a docstring's quotes before
    it, nothing but a comment marker or quotes before it on its line) and its text follows
    (``[Note: x] The ...``); a reference sits in a sentence (a wrapped one may open a line, and
    ends a clause: ``[Note: x]).``), or names its file after it (``[Note: x] (`file.py`)`` in
    the docs, ``[Note: x]: ...`` in a test's summary)."""
    for found in NOTE.finditer(text):
        name = note_name(found)
        line_start = text.rfind("\n", 0, found.start()) + 1
        before = text[line_start : found.start()].strip()
        previous = text[text.rfind("\n", 0, max(line_start - 1, 0)) + 1 : line_start].strip()
        after = text[found.end() : found.end() + 3]
        opens = before in ("", "#", "//", '"""') and (
            previous in ("", "#", "//") or previous.endswith('"""') or before in ("#", '"""')
        )
        yield name, opens and not after.startswith((" (`", ":", " in", ")", ".", ",", ";"))


def test_every_note_reference_names_exactly_one_note() -> None:
    sources = [
        p
        for folder in ("pipesvc", "tests", "bench", "docs", "protos")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".md", ".proto")
        and GENERATED not in p.parents
        and p != Path(__file__).resolve()  # its examples below
    ] + list(ROOT.glob("*.md"))
    notes: dict[str, list[str]] = {}
    references: dict[str, list[str]] = {}
    for path in sources:
        for name, is_note in notes_in(path.read_text()):
            if name != "...":  # the docs' own description of the convention
                kept = notes if is_note else references
                kept.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {n: f for n, f in references.items() if n not in notes} == {}, "no such note"
    assert {n: f for n, f in notes.items() if len(f) > 1} == {}, "a note written twice"


REFERENCE_FILE = re.compile(r"\]\)?\s*(?:#\s*)?in\s+(?:#\s*)?``?([A-Za-z_][\w./]*\w)``?")
"""What a reference names after the note: ``[Note: x] in ``pkg.module`` `` or ``in path.py``."""


def test_every_note_reference_that_names_a_file_names_the_notes_own() -> None:
    sources = [
        p
        for folder in ("pipesvc", "tests", "bench", "docs", "protos")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".md", ".proto") and GENERATED not in p.parents
    ] + list(ROOT.glob("*.md"))
    homes = {
        name: path.relative_to(ROOT).as_posix()
        for path in sources
        for name, is_note in notes_in(path.read_text())
        if is_note
    }
    wrong = []
    for path in sources:
        text = path.read_text()
        for found in NOTE.finditer(text):
            name = note_name(found)
            named = REFERENCE_FILE.match(text, found.end() - 1)
            if named is None or name not in homes:
                continue
            where = named.group(1)
            if not where.endswith((".py", ".md", ".proto")):
                if "." not in where:
                    continue  # "in the docs", "in it": no file
                where = where.replace(".", "/") + ".py"
            if not homes[name].endswith(where):
                wrong.append(f"{path.relative_to(ROOT)}: [Note: {name}] is in {homes[name]}")
    assert wrong == []


def test_notes_and_references_are_told_apart() -> None:
    text = (
        '"""[Note: a] What a is.\n\nSee [Note: b] in x.py and\n[Note: c].\n"""\n'
        "# [Note: d] A comment's note.\n[Note: e] (`f.py`) The docs' pointer.\n"
        "x = 1  # waits (see\n# [Note: d]).\n"
    )
    assert list(notes_in(text)) == [
        ("a", True), ("b", False), ("c", False), ("d", True), ("e", False), ("d", False)
    ]  # fmt: skip
