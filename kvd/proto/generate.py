"""Generate kvd/proto/*_pb2*.py from protos/kvd.proto.

Run with ``make proto`` (or ``python -m kvd.proto.generate``). The import path
``kvd/proto=protos`` makes protoc emit ``from kvd.proto import kvd_pb2``, so the
generated modules import as part of the package. ``tests/test_proto.py``
regenerates into a temporary folder and fails if the committed files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency only

    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-Ikvd/proto={REPO / 'protos'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"kvd/proto/kvd.proto",
    ]
    # grpc_tools ships the well-known protos; add their include path.
    import grpc_tools

    args.insert(1, f"-I{Path(grpc_tools.__file__).parent / '_proto'}")
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    out = out_root / "kvd" / "proto"
    return sorted(out.glob("kvd_pb2*.py*"))


def main() -> None:
    files = generate(REPO)
    for f in files:
        print(f"generated {f.relative_to(REPO)}")


if __name__ == "__main__":
    sys.exit(main())
