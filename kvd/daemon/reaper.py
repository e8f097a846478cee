"""Shared memory that outlives its engine: found and removed.

A worker that is killed (SIGKILL, the OOM killer) never unregisters, and the
KV cache regions it made in /dev/shm stay behind; a node that restarts
engines a few times fills /dev/shm, and then every engine on it fails at
start. Two signs tell a daemon that a region's creator is gone
(``why_gone``): the shared lock ``kvd.caches`` holds on each region it makes
is free (the kernel lets go of it however the process ends, and it is seen
from any pid namespace: a Kubernetes sidecar without shareProcessNamespace,
as deploy/ runs it), or, for a creator of an earlier release, the pid its
region's name carries has exited (``shm.OWNED_NAME``; only a daemon in the
same pid namespace can tell). ``Reaper`` checks, once a second, every
registered worker's regions. A registration whose creators are all gone is
retired: its pulls end and it accepts nothing new, but what it already
published is still served (the daemon holds the mapping, and nobody writes
the memory any more), so a decode on its way loses nothing. Once nothing
holds it, or after ``GONE_GRACE_SECONDS``, it ends as an unregister would
(what is still published ends, naming the reason), and its regions are
unlinked once the daemon has unmapped them: /dev/shm is freed within
seconds. A registration that ends while its creator still holds its files
(it unregistered, or registered its rank again in new memory) leaves them
watched (``Leftovers``): a creator that then dies without unlinking them
(a restart while the old process is still going down) has them unlinked
at the next check. At start, ``remove_orphans`` removes
regions whose creator's pid is gone (in this pid namespace: a lock free at
start could be an earlier release's live worker, which holds none).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Set

from kvd.daemon.registration import Registration
from kvd.regions import shm

log = logging.getLogger("kvd.daemon")

CHECK_SECONDS = 1.0
GONE_GRACE_SECONDS = 5.0  # a dead worker's publications stay readable this long, at most


def remove_orphans() -> list[str]:
    """Unlink every region in /dev/shm made in this pid namespace by a process that is gone."""
    removed = [name for name in shm.orphans(shm.pid_namespace()) if shm.unlink_name(name)]
    if removed:
        log.info("removed %d shared-memory regions of exited processes: %s", len(removed), ", ".join(removed[:8]))
    return removed


def creators(names: list[str], namespace: str) -> set[int]:
    """The pids that made these regions, where this namespace can tell."""
    return {pid for n in names if (pid := shm.creator_pid(n, namespace)) is not None}


def why_gone(reg: Registration, namespace: str) -> str:
    """Why the worker of ``reg`` is gone; "" while it may still live, or
    nothing can tell. Its alive token, held by the registering process, is
    the word on it where it sent one; else its regions tell: their
    creators' pids (in ``namespace``) have all exited, or every lock seen
    held when they were mapped is free."""
    if reg.alive is not None:
        if not reg.alive.let_go():
            return ""
        pid = shm.creator_pid(reg.alive.name, namespace)  # where this namespace can name it
        return f"worker gone: pid {pid} exited without unregistering" if pid is not None else GONE_BY_LOCK
    files = [r for r in reg.regions.values() if isinstance(r, shm.ShmRegion)]
    pids = creators([r.name for r in files], namespace)
    if pids and not any(shm.pid_alive(p) for p in pids):
        return f"worker gone: pid {', '.join(map(str, sorted(pids)))} exited without unregistering"
    locked = [r for r in files if r.lock_probe >= 0]
    if locked and all(r.creator_gone() for r in locked):
        return GONE_BY_LOCK
    return ""


GONE_BY_LOCK = "worker gone: the process that made its memory let go of it (it exited) without unregistering"


MAX_WATCHED = 4096  # files watched at most (a descriptor each); past it the oldest are let go of, never unlinked


class Leftovers:
    """The files of registrations that ended while their creator still held
    them (it unregistered, or registered its rank again in new memory, and
    may yet die without unlinking them: a restart while the old process is
    still going down), watched until the creator lets go (``sweep``): then
    nobody will map them again and they are unlinked. Files removed
    meanwhile (by their creator) are forgotten."""

    def __init__(self) -> None:
        self._watched: dict[tuple[int, int], shm.CreatorWatch] = {}

    def watch(self, watches: Iterable[shm.CreatorWatch]) -> None:
        """Watch these files (the watches are this one's to close). A watch
        that cannot be made (no descriptor left) is logged, never raised:
        the registration's end goes on."""
        try:
            made = list(watches)
        except OSError as e:
            log.warning("files of an ended registration not watched for their creator's end: %s", e)
            return
        for w in made:
            if w.file_id in self._watched:
                w.close()
                continue
            self._watched[w.file_id] = w
            while len(self._watched) > MAX_WATCHED:
                self._watched.pop(next(iter(self._watched))).close()

    def sweep(self, in_use: Set[tuple[int, int]] = frozenset()) -> list[str]:
        """Unlink the watched files whose creator let go of them, but those a
        live registration maps (``in_use``: file ids); the names unlinked."""
        unlinked = []
        for key, w in list(self._watched.items()):
            state = "held" if key in in_use else w.state()
            if state == "held":
                continue
            del self._watched[key]
            w.close()
            if state == "let go" and shm.unlink_name(w.name):
                unlinked.append(w.name)
        if unlinked:
            log.info("removed %d shared-memory regions their creator let go of after its registration ended: %s",
                     len(unlinked), ", ".join(unlinked[:8]))
        return unlinked

    def __len__(self) -> int:
        return len(self._watched)


class Reaper:
    """Retires registrations whose worker is gone (``retire(rank, reason,
    now)``), and ends them once released (``release(now)``)."""

    def __init__(self, registered: Callable[[], Mapping[tuple[int, int], Registration]],
                 retire: Callable[[tuple[int, int], str, float], None], release: Callable[[float], None],
                 leftovers: Leftovers | None = None) -> None:
        self.registered = registered  # live rank -> its registration
        self.retire = retire
        self.release = release
        self.leftovers = leftovers
        self.namespace = shm.pid_namespace()

    def check(self, now: float) -> list[tuple[int, int]]:
        """Retire each registration whose worker is gone (``why_gone``); the ranks retired."""
        retired = []
        for rank, reg in list(self.registered().items()):
            reason = why_gone(reg, self.namespace)
            if reason:
                log.warning("retiring registration of rank tp%d/pp%d: %s; what it published is served for up to %gs",
                            rank[0], rank[1], reason, GONE_GRACE_SECONDS)
                self.retire(rank, reason, now)
                retired.append(rank)
        return retired

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            now = time.monotonic()
            self.check(now)
            self.release(now)
            if self.leftovers is not None:
                self.leftovers.sweep({r.file_id for reg in self.registered().values() for r in reg.regions.values()
                                      if isinstance(r, shm.ShmRegion)})
