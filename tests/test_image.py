"""The sidecar image, built and run (``pytest -m docker``): ``deploy/image-test``
builds it, starts a prefill and a decode container, runs the verified demo
against them, scrapes both daemons' /metrics and stops them cleanly.

Skipped, with the reason, where no docker daemon answers. By default it
builds as this project's machines must, with no image registry: a Debian
base made with debootstrap and a wheelhouse made with pip (``--local``);
``KVD_IMAGE_TEST_ARGS`` replaces those arguments (empty: the Dockerfile's own
base, packages from the index).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]


def _docker_answers() -> str:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30)
    return "" if r.returncode == 0 else f"no docker daemon answers: {(r.stderr or r.stdout).strip()[:200]}"


def test_the_image_builds_and_runs_as_a_prefill_and_decode_sidecar_pair():
    why = _docker_answers()
    if why:
        pytest.skip(f"DOCKER NOT TESTED: {why}")
    # A clean docker state (no cached base, image or build cache), as on a machine that never built it.
    args = os.environ.get("KVD_IMAGE_TEST_ARGS", "--local --fresh").split()
    # Its own session, so a timeout stops the script with SIGTERM (it removes its containers), then the rest.
    proc = subprocess.Popen([str(REPO / "deploy" / "image-test"), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=3500)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"deploy/image-test did not finish in 3500 s:\n{out[-6000:]}") from None
    assert proc.returncode == 0, out[-6000:]
    # The demo verified every byte on the decode side, through the containers.
    assert "verified       every valid token of every block matches" in out, out[-3000:]
    assert "exit codes: 0 0" in out and "image-test: passed" in out
    assert "kvd 0." in out.split("the run stage as its own user", 1)[1].split("==", 1)[0], out[-3000:]  # kvd --version, as user 10001
    print(out[-2500:])
