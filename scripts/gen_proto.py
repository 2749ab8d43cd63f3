"""Generates the Python gRPC stubs from proto/splitserve/v1/*.proto into the same folder.

The stubs are committed (so `pip install` alone gives a working package) and never edited by
hand: tests/test_proto_stubs.py regenerates them into a temporary folder and diffs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"


def proto_files(root: Path = PROTO_ROOT) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.glob("splitserve/v1/*.proto"))


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> None:
    include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
    args = [
        "protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_files(root),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
