"""The committed generated code must match protos/kvd.proto."""

from pathlib import Path

import pytest

from kvd.proto.generate import REPO, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for f in fresh:
        committed = REPO / "kvd" / "proto" / f.name
        assert committed.exists(), f"{committed} is missing; run `make proto`"
        assert committed.read_bytes() == f.read_bytes(), f"{committed.name} is stale; run `make proto`"
