"""Shared memory outlives a killed engine no longer (real daemons, real
workers in their own processes, /dev/shm itself).

A worker killed with SIGKILL never unregisters; the daemon sees its regions'
creator gone (its pid exited, or, from any pid namespace, the lock it held
on them is free) and retires the registration: what it published is served for
a grace of 5 s at most, then it ends (naming why) and the regions are
unlinked, within seconds (here a publication of a 600 s lease that nobody
reads). A daemon that starts removes regions
whose creator exited; a live process's regions, and regions made in another
pid namespace, are left alone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvd.client import daemon_status
from kvd.regions import shm
from tests.conftest import REPO, make_worker

WORKER = """
import fcntl, sys, time
import kvd.caches
from kvd.caches import allocate_kv_caches
from kvd.client import KvdClient
from kvd.spec import KVCacheSpec, ModelInfo, WorkerId, parse_layout
spec = KVCacheSpec(16, 4, 16, "bfloat16", parse_layout("NHD"), 64)
if "unseen" in sys.argv:  # memory that says nothing of its maker, as CUDA IPC memory: no lock (as an earlier release made it)
    flock, fcntl.flock = fcntl.flock, lambda *args: None
caches = allocate_kv_caches(spec, [f"model.layers.{i}.self_attn.attn" for i in range(4)])
if "unseen" in sys.argv:
    fcntl.flock = flock
if sys.argv[1] != "-":
    if "wait" in sys.argv:
        from kvd.caches import _REGIONS
        print(" ".join(r.name for r in _REGIONS.values()), flush=True)
        sys.stdin.readline()  # register when told
    client = KvdClient(sys.argv[1], WorkerId("prefill"))
    client.wait_ready()
    client.register(caches, ModelInfo(4, 4), spec)
    client.publish("r", [[1, 2]], 32, lease_seconds=600)
from kvd.caches import _REGIONS
print(" ".join(r.name for r in _REGIONS.values()), flush=True)
time.sleep(600)
"""


def _worker(address: str, *args: str, prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", WORKER, address, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    assert proc.stdout is not None
    names = proc.stdout.readline().split()
    assert names, "the worker made no region"
    return proc, names


def _in_shm(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(os.path.join(shm.SHM_DIR, n))]


def test_a_killed_workers_regions_are_removed_and_its_registration_ends(daemons):
    p = daemons.start("prefill")
    proc, names = _worker(p.grpc)
    assert _in_shm(names) == names and len(daemon_status(p.grpc).workers) == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Both within the deadline, each checked on its own: another daemon starting on this host meanwhile
    # removes the orphaned regions itself (remove_orphans), before this one has retired the registration.
    deadline = time.monotonic() + 10
    while (_in_shm(names) or daemon_status(p.grpc).workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_shm(names) == [], "the killed worker's regions are still in /dev/shm"
    assert daemon_status(p.grpc).workers == []
    log = p.log()
    assert f"pid {proc.pid} exited without unregistering" in log
    # Negative control: a live worker's regions stay, and it still works.
    live = make_worker(p.grpc, "prefill")
    time.sleep(2.5)
    assert len(daemon_status(p.grpc).workers) == 1 and live.client.publish("r2", [[1]], 16).generation > 0


# As deploy/kubernetes runs it: the engine's container has a pid namespace of its own, so the pid in
# its regions' names means nothing to the daemon. ``--kill-child``: the worker dies with unshare.
OTHER_PID_NAMESPACE = ("unshare", "--pid", "--fork", "--kill-child")
needs_unshare = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a pid namespace of its own needs root and unshare")


def _until_gone(p, names: list[str], within: float = 10) -> None:
    deadline = time.monotonic() + within
    while (_in_shm(names) or daemon_status(p.grpc).workers) and time.monotonic() < deadline:
        time.sleep(0.1)


@needs_unshare
def test_a_killed_worker_in_another_pid_namespace_is_found_gone_by_its_lock(daemons):
    p = daemons.start("prefill")
    proc, names = _worker(p.grpc, prefix=OTHER_PID_NAMESPACE)
    try:
        assert all(shm.creator_pid(n, shm.pid_namespace()) is None for n in names), "the worker shares the daemon's pid namespace"
        # Control: alive, it stays registered past two of the reaper's checks, its regions in place.
        time.sleep(2.5)
        assert _in_shm(names) == names and len(daemon_status(p.grpc).workers) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _until_gone(p, names)
        assert _in_shm(names) == [], "the killed worker's regions are still in /dev/shm"
        assert daemon_status(p.grpc).workers == []
        assert "the process that made its memory let go of it (it exited) without unregistering" in p.log()
    finally:
        proc.kill()
        for n in names:
            shm.unlink_name(n)


@needs_unshare
def test_a_killed_worker_whose_memory_names_no_maker_is_found_gone_by_its_alive_token(daemons):
    """Its regions hold no lock and their pid means nothing here (CUDA IPC
    memory names no file at all): the page ``KvdClient.register`` sends as
    its alive token is what tells the daemon."""
    p = daemons.start("prefill")
    proc, names = _worker(p.grpc, "unseen", prefix=OTHER_PID_NAMESPACE)
    try:
        time.sleep(2.5)  # control: alive, it stays registered past two of the reaper's checks
        assert _in_shm(names) == names and len(daemon_status(p.grpc).workers) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _until_gone(p, names)
        assert daemon_status(p.grpc).workers == [], "the killed worker is still registered"
        assert _in_shm(names) == [], "the killed worker's regions are still in /dev/shm"
        assert "the process that made its memory let go of it (it exited) without unregistering" in p.log()
    finally:
        proc.kill()
        for n in names:
            shm.unlink_name(n)


@needs_unshare
def test_a_worker_that_dies_after_its_rank_registered_again_leaves_nothing_behind(daemons):
    """A restart while the old process is still going down: the new worker
    registers the rank while the old one holds its memory, then the old one
    is killed. Its files are no registration's any more, and still removed."""
    p = daemons.start("prefill")
    old, old_names = _worker(p.grpc, prefix=OTHER_PID_NAMESPACE)
    new, new_names = _worker(p.grpc, "wait", prefix=OTHER_PID_NAMESPACE)
    try:
        assert new.stdin is not None and new.stdout is not None
        new.stdin.write("\n")
        new.stdin.flush()
        assert new.stdout.readline().split() == new_names  # registered in the old one's place, and published
        # Control: while the old worker lives, its memory is its own, past two of the reaper's checks.
        time.sleep(2.5)
        assert _in_shm(old_names) == old_names
        old.send_signal(signal.SIGKILL)
        old.wait()
        deadline = time.monotonic() + 10
        while _in_shm(old_names) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _in_shm(old_names) == [], "the killed worker's regions are still in /dev/shm"
        assert "their creator let go of after its registration ended" in p.log()
        # The live worker is not taken for the dead one.
        time.sleep(2.5)
        assert _in_shm(new_names) == new_names and len(daemon_status(p.grpc).workers) == 1
    finally:
        for proc in (old, new):
            proc.kill()
            proc.wait()
        for n in [*old_names, *new_names]:
            shm.unlink_name(n)


@pytest.mark.alone  # any daemon starting beside it would remove the orphan first: every daemon sweeps /dev/shm
def test_a_daemon_that_starts_removes_regions_of_exited_processes_only(daemons, tmp_path):
    dead, dead_names = _worker("-")  # no daemon yet: made, then killed before any registration
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    alive, alive_names = _worker("-")
    # A region made in another pid namespace: its pid means nothing here, so it is never touched.
    foreign = f"kvd-{dead.pid}-n{int(shm.pid_namespace(), 16) + 1:x}-0123456789ab"
    with open(os.path.join(shm.SHM_DIR, foreign), "wb") as f:
        f.write(b"x")
    try:
        assert _in_shm(dead_names) == dead_names
        p = daemons.start("prefill")
        assert p.grpc  # started: its orphans are removed before it serves
        assert _in_shm(dead_names) == []
        assert _in_shm(alive_names) == alive_names
        assert _in_shm([foreign]) == [foreign]
        assert "removed" in p.log() and dead_names[0] in p.log()
    finally:
        alive.kill()
        alive.wait()
        for n in [*alive_names, foreign]:
            shm.unlink_name(n)
