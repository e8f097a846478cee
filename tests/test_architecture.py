"""The architecture as checks: the pure core, the layers, the public API, module sizes."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(*config: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *config], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    r = lint_imports()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout


def test_a_forbidden_import_in_the_core_is_caught(tmp_path):
    # Negative control: the same kind of contract, on an import the core
    # really makes (numpy), must come back broken, naming the importer.
    cfg = tmp_path / "broken.toml"
    cfg.write_text('[tool.importlinter]\nroot_packages = ["kvd"]\ninclude_external_packages = true\n\n'
                   '[[tool.importlinter.contracts]]\nname = "core without numpy"\ntype = "forbidden"\n'
                   'source_modules = ["kvd.core"]\nforbidden_modules = ["numpy"]\n')
    r = lint_imports("--config", str(cfg))
    assert r.returncode != 0 and "BROKEN" in r.stdout and "kvd.core.plan -> numpy" in r.stdout, r.stdout[-2000:]


def import_cycles(package: str) -> list[list[str]]:
    """Every set of ``package``'s modules that import one another in a circle,
    imports under TYPE_CHECKING included: a class that names its holder only
    for the type checker still reaches back into it."""
    import grimp

    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    modules = {m for m in graph.modules if not m.startswith(f"{package}.proto")}
    edges = {m: {n for n in graph.find_modules_directly_imported_by(m) if n in modules and n != m} for m in modules}
    # Tarjan's strongly connected components: any with more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in edges[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return cycles


# The gRPC edge: the only modules that may import the generated protobuf.
# Everything past them speaks the core's dataclasses (kvd.core.requests).
PROTOBUF_EDGE = {
    "kvd.convert",  # protobuf <-> core, for all the others
    "kvd.daemon.service",  # the servicers
    "kvd.daemon.outbound",  # calls to peer daemons
    "kvd.client",  # the worker API (its messages are public)
    "kvd.caches",  # describe(): a Register request's regions and groups (public)
    "kvd.transport.codec",  # the data plane's control bodies
}


def protobuf_importers(package: str) -> set[str]:
    """``package``'s modules (outside its generated ``proto``) that import it,
    imports under TYPE_CHECKING included."""
    import grimp

    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    proto = {m for m in graph.modules if m.startswith(f"{package}.proto")}
    return {m for m in graph.modules if m not in proto and graph.find_modules_directly_imported_by(m) & proto}


def test_protobuf_is_imported_only_at_the_grpc_edge():
    found = protobuf_importers("kvd")
    assert found <= PROTOBUF_EDGE, f"protobuf past the edge: {sorted(found - PROTOBUF_EDGE)}"
    assert len(PROTOBUF_EDGE) <= 7
    assert not any(m.startswith("kvd.core") or m == "kvd.daemon.puller" for m in PROTOBUF_EDGE)


def test_a_protobuf_import_past_the_edge_is_caught(tmp_path, monkeypatch):
    # Negative control: a part that names a message only for the type checker still imports protobuf.
    pkg = tmp_path / "edge_pkg"
    (pkg / "proto").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "proto" / "__init__.py").write_text("")
    (pkg / "proto" / "msgs_pb2.py").write_text("class Request: ...\n")
    (pkg / "edge.py").write_text("from edge_pkg.proto import msgs_pb2\n")
    (pkg / "part.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from edge_pkg.proto import msgs_pb2\n")
    (pkg / "pure.py").write_text("import edge_pkg.edge\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert protobuf_importers("edge_pkg") == {"edge_pkg.edge", "edge_pkg.part"}


def test_no_import_cycles_between_modules():
    assert import_cycles("kvd") == []


def test_a_cycle_through_type_checking_imports_is_caught(tmp_path, monkeypatch):
    # Negative control: a holder and its part, the part naming the holder only
    # under TYPE_CHECKING (as the daemon's sides once did), is a cycle.
    pkg = tmp_path / "holder_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "holder.py").write_text("from holder_pkg.part import Part\n\nclass Holder:\n    part = Part\n")
    (pkg / "part.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from holder_pkg.holder import Holder\n\n"
                                 "class Part:\n    holder: 'Holder'\n")
    (pkg / "alone.py").write_text("import holder_pkg.part\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("holder_pkg") == [["holder_pkg.holder", "holder_pkg.part"]]


def test_no_hand_written_module_is_over_450_lines():
    big = {str(p.relative_to(REPO)): n for p in (REPO / "kvd").rglob("*.py")
           if "proto" not in p.parts and (n := len(p.read_text().splitlines())) > 450}
    assert big == {}


def test_test_modules_share_helpers_through_support_modules_not_each_other():
    """What tests share lives in conftest, kvd.testing or a tests/*_support
    module: a test module imported by another runs its fixtures twice and
    hides who depends on what."""
    importers = {p.name: line.strip() for p in (REPO / "tests").glob("test_*.py") for line in p.read_text().splitlines()
                 if re.match(r"\s*(from tests\.test_|import tests\.test_|from tests import .*\btest_)", line)}
    assert importers == {}


PUBLIC = {
    "kvd.client": ["KvdClient", "daemon_status", "infer_spec_from_tensors", "Finished"],
    "kvd.caches": ["allocate_kv_caches", "adopt_into_shm", "describe", "release_all"],
    "kvd.spec": ["KVCacheSpec", "ModelInfo", "WorkerId", "parse_layout", "NAMED_LAYOUTS", "GroupSpec", "GroupKind", "SLIDING_WINDOW"],
    "kvd.errors": ["KvdError", "InvalidArgument", "Incompatible", "Status", "from_code"],
    "kvd.auth": ["AuthConfig"],
    "kvd.proto": ["kvd_pb2", "kvd_pb2_grpc"],
    "kvd.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_api_imports_where_the_docs_say(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert missing == []


def test_the_vllm_connector_stays_where_vllm_loads_it():
    # vLLM loads it by module path; importing kvd never imports vLLM.
    spec = importlib.util.find_spec("kvd.integrations.vllm")
    assert spec is not None and spec.origin is not None
    assert "class KvdConnector(KVConnectorBase_V1, SupportsHMA)" in Path(spec.origin).read_text()
    r = subprocess.run([sys.executable, "-c", "import sys, kvd, kvd.client, kvd.caches, kvd.spec; print('vllm' in sys.modules)"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.stdout.strip() == "False", r.stderr
