"""Regenerates the committed wire code under pipesvc/v1 from protos/ (a developer tool).

Besides the runtime modules it writes typed stubs (``.pyi``) with mypy-protobuf's plugins, so
mypy --strict checks message fields and RPC calls (method names, request and reply types) at
every call site instead of treating the wire code as ``Any``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

PROTO_FILES = ("common.proto", "stage.proto", "coordinator.proto")
PLUGINS = ("protoc-gen-mypy", "protoc-gen-mypy_grpc")
"""mypy-protobuf's stub generators (a dev dependency) for messages and services."""


def _plugin(name: str) -> str:
    """The path of protoc plugin ``name``: beside this Python first, then on PATH.

    Raises:
        RuntimeError: the plugin is not installed.
    """
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"protoc plugin {name!r} not found; install the dev extra (mypy-protobuf)"
        )
    return found


def generate(repo_root: Path, out_dir: Path) -> None:
    """Runs protoc (from grpcio-tools) on protos/pipesvc/v1 into ``out_dir``.

    Raises:
        RuntimeError: protoc failed, or a stub plugin is missing.
    """
    from grpc_tools import protoc  # dev dependency, imported only here

    proto_root = repo_root / "protos"
    include = Path(protoc.__file__).parent / "_proto"
    plugins = [f"--plugin={name}={_plugin(name)}" for name in PLUGINS]
    for name in PROTO_FILES:
        args = [
            "protoc",
            f"-I{proto_root}",
            f"-I{include}",
            *plugins,
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--mypy_out=quiet:{out_dir}",
            f"--mypy_grpc_out=quiet:{out_dir}",
            str(proto_root / "pipesvc" / "v1" / name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {name}")


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    generate(root, root)
    sys.exit(0)
