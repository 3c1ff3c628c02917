"""Regenerates the committed wire code under pipesvc/v1 from protos/ (a developer tool)."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_FILES = ("common.proto", "stage.proto", "coordinator.proto")


def generate(repo_root: Path, out_dir: Path) -> None:
    """Runs protoc (from grpcio-tools) on protos/pipesvc/v1 into ``out_dir``.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc  # dev dependency, imported only here

    proto_root = repo_root / "protos"
    include = Path(protoc.__file__).parent / "_proto"
    for name in PROTO_FILES:
        args = [
            "protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto_root / "pipesvc" / "v1" / name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {name}")


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    generate(root, root)
    sys.exit(0)
