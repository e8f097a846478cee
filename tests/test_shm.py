"""POSIX shm regions: a /dev/shm too small for a cache fails at creation with a
clear error, not with SIGBUS at the first page past the limit (a container's
/dev/shm is 64 MiB unless given more); a closed region stays mapped while a
view of it lives."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

CREATE = ("import os, atexit; from kvd.regions.shm import ShmRegion; "
          "atexit.register(lambda: print('left in /dev/shm:', sorted(os.listdir('/dev/shm')))); "
          "r = ShmRegion.create({size}); r.tensor[-1] = 7; r.unlink(); print('created')")


def _in_small_shm(size: int) -> subprocess.CompletedProcess[str]:
    """Create a region in a private mount namespace whose /dev/shm is an 8 MiB tmpfs."""
    script = f"mount -t tmpfs -o size=8m kvd-test /dev/shm && exec {sys.executable} -c \"{CREATE.format(size=size)}\""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a private /dev/shm")
def test_a_region_larger_than_dev_shm_is_refused_clearly():
    r = _in_small_shm(64 << 20)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # an exception, not a signal (SIGBUS is -7)
    assert "ResourceExhausted" in r.stderr and "/dev/shm has no room for a 64 MiB KV cache region" in r.stderr, r.stderr[-2000:]
    assert "--shm-size" in r.stderr
    assert "left in /dev/shm: []" in r.stdout, r.stdout  # the half-made region was unlinked
    # Control: one that fits is created and written to the last byte.
    ok = _in_small_shm(4 << 20)
    assert ok.returncode == 0 and "created" in ok.stdout, ok.stderr[-2000:]


# A region closed under a view still in use (a worker's registration ended while a copy thread lands
# a pull into it, or an engine still holds its cache tensor), then the view used: in a process of its
# own, since before the fix the use killed it (SIGSEGV, exit -11).
CLOSED_UNDER_A_VIEW = """
import gc
from kvd.regions.shm import ShmRegion
def mapped(name): return name in open('/proc/self/maps').read()
r = ShmRegion.create(1 << 20)
view = r.tensor[4096:8192].view(torch.int32)
r.close()  # its creator's: unlinked too
view.fill_(7)
print('sum', int(view.sum()), 'mapped', mapped(r.name))
import time
from kvd.regions import unmapper
from kvd.regions.unmapper import unmaps_pending
with unmapper.retrying:  # the unmapping thread waits: what dropping the view did, alone
    del view; gc.collect()
    print('after the view: pending', unmaps_pending(), 'mapped', mapped(r.name))
end = time.monotonic() + 5
while (mapped(r.name) or unmaps_pending()) and time.monotonic() < end:  # the count drops just after the unmap
    time.sleep(0.05)
print('then: pending', unmaps_pending(), 'mapped', mapped(r.name))
"""


def test_a_closed_region_stays_mapped_while_a_view_of_it_lives():
    """Its mapping ends with its last view, and not before, and off the thread that drops that view
    (it may be the daemon's event loop). Negative control: the region's tensor
    from torch.frombuffer, which holds no export of the mmap: the view's use killed the process
    (exit -11)."""
    r = subprocess.run([sys.executable, "-c", "import torch" + CLOSED_UNDER_A_VIEW], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    # Unmapped by kvd's background thread (within its 0.5 s poll), not by the thread that dropped the view.
    assert r.stdout.splitlines() == ["sum 7168 mapped True", "after the view: pending 1 mapped True", "then: pending 0 mapped False"], r.stdout


def test_a_region_knows_when_its_file_is_removed_or_replaced():
    """What a same-host reader asks of an owner's mapped region (daemon/peers.py
    drop_removed): its file still there is kept; gone, or its name now naming
    another file (a worker that made new memory under the old name), is removed."""
    from kvd.regions.shm import ShmRegion, unlink_name

    made = ShmRegion.create(1 << 16)
    seen = ShmRegion.open("r", made.name, 1 << 16)
    try:
        assert not seen.removed()
        assert unlink_name(made.name)
        assert seen.removed()
        again = ShmRegion.create(1 << 16, name=made.name)  # the same name, another file
        fresh = ShmRegion.open("r2", made.name, 1 << 16)
        try:
            assert seen.removed() and not fresh.removed()
        finally:
            fresh.close()
            again.close()
    finally:
        seen.close()
        made.close()


QUEUED_AT_EXIT = """
import sys, time
from kvd.regions import close_later
close_later(lambda: time.sleep(0.5))  # one running as the process ends
close_later(lambda: open(sys.argv[1], 'w').write('closed'))  # and one queued behind it
"""


def test_closes_queued_as_a_process_ends_are_run_before_it_goes(tmp_path):
    """A daemon that stops (tcp transport: it returns, and Python shuts
    down) still runs the closes it queued: one may unlink a gone worker's
    files. Negative control: the unmapping thread left to die with the
    interpreter (no exit hook): the file was never written."""
    out = tmp_path / "closed"
    r = subprocess.run([sys.executable, "-c", QUEUED_AT_EXIT, str(out)], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.exists() and out.read_text() == "closed"


def test_only_a_creators_shared_lock_makes_a_region_watched():
    """The registering daemon watches a region for its creator's end only
    where the creator holds its shared lock. Another prober's exclusive try
    (a same-host reader, a second daemon: microseconds) on a file nobody
    holds, as an earlier release's worker made it, must not be taken for a
    creator's lock: the next check would find it free and retire the live
    worker. Negative control, any lock taken for the creator's: watched."""
    import fcntl
    import uuid

    from kvd.regions import shm
    from kvd.regions.shm import ShmRegion

    made = ShmRegion.create(1 << 16)  # this release's: held shared while mapped
    old = f"kvd-test-unlocked-{uuid.uuid4().hex[:8]}"  # an earlier release's: no lock
    fd = os.open(os.path.join(shm.SHM_DIR, old), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 16)
    try:
        held = ShmRegion.open("a", made.name, 1 << 16, watch=True)
        assert held.lock_probe >= 0 and not held.creator_gone()
        held.close()
        assert ShmRegion.open("a", made.name, 1 << 16).lock_probe == -1  # a reader keeps no probe
        fcntl.flock(fd, fcntl.LOCK_EX)  # another prober, caught mid-try
        unheld = ShmRegion.open("b", old, 1 << 16, watch=True)
        assert unheld.lock_probe == -1, "another prober's exclusive lock was taken for the creator's"
        unheld.close()
    finally:
        os.close(fd)
        shm.unlink_name(old)
        made.close()


def test_threads_asking_for_the_alive_token_at_once_get_one_held_page():
    script = """
import threading
from kvd import caches
from kvd.regions import shm
go = threading.Barrier(8)
names = []
def ask():
    go.wait()
    names.append(caches.alive_token())
threads = [threading.Thread(target=ask) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
watch = shm.CreatorWatch.open(names[0], "alive_shm")  # refused unless held
print(len(set(names)), watch.let_go())
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "False"], r.stdout
