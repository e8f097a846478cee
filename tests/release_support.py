"""Releases as the tests find them: through CHANGELOG.md (a clone may carry
no tags), and the previous one checked out into a worktree once a session
(the ``previous`` fixture) for the mixed-version tests."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvd
from tests.conftest import REPO

RELEASE = re.compile(r"^## (\d+\.\d+\.\d+) \(([0-9a-f]{7,40}), \d{4}-\d{2}-\d{2}\)$", re.M)


def releases() -> list[tuple[str, str]]:
    """(version, commit) of every release CHANGELOG.md names, newest first."""
    return RELEASE.findall((REPO / "CHANGELOG.md").read_text())


def previous_release() -> tuple[str, str]:
    """The newest release older than this tree's version."""
    mine = tuple(int(x) for x in kvd.__version__.split(".")[:3])
    older = [(v, c) for v, c in releases() if tuple(int(x) for x in v.split(".")) < mine]
    assert older, f"CHANGELOG.md names no release before {kvd.__version__}"
    return older[0]


@pytest.fixture(scope="session")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    version, commit = previous_release()
    tree = tmp_path_factory.mktemp("release") / f"kvd-{version}"
    r = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"release {version} ({commit}) could not be checked out: {r.stderr}"
    try:
        yield version, tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True, timeout=120)


