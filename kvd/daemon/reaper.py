"""Shared memory that outlives its engine: found and removed.

A worker that is killed (SIGKILL, the OOM killer) never unregisters, and the
KV cache regions it made in /dev/shm stay behind, owned by a dead pid; a node
that restarts engines a few times fills /dev/shm, and then every engine on it
fails at start. ``kvd.caches`` names each region it makes for its creator
(pid and pid namespace, ``shm.OWNED_NAME``), so a daemon in the same pid
namespace can tell. ``Reaper`` checks, once a second, the creators of every
registered worker's regions. A registration whose creators are all gone is
retired: its pulls end and it accepts nothing new, but what it already
published is still served (the daemon holds the mapping, and nobody writes
the memory any more), so a decode on its way loses nothing. Once nothing
holds it, or after ``GONE_GRACE_SECONDS``, it ends as an unregister would
(what is still published ends, naming the reason), and its regions are
unlinked once the daemon has unmapped them: /dev/shm is freed within
seconds. At start, ``remove_orphans`` removes regions whose creator is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

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


class Reaper:
    """Retires registrations whose worker is gone (``retire(rank, reason,
    now)``), and ends them once released (``release(now)``)."""

    def __init__(self, registered_names: Callable[[], Mapping[tuple[int, int], list[str]]],
                 retire: Callable[[tuple[int, int], str, float], None], release: Callable[[float], None]) -> None:
        self.registered_names = registered_names  # live rank -> the shm names of its regions
        self.retire = retire
        self.release = release
        self.namespace = shm.pid_namespace()

    def check(self, now: float) -> list[tuple[int, int]]:
        """Retire each registration whose regions' creators have all exited; the ranks retired."""
        retired = []
        for rank, names in list(self.registered_names().items()):
            pids = creators(names, self.namespace)
            if pids and not any(shm.pid_alive(p) for p in pids):
                reason = f"worker gone: pid {', '.join(map(str, sorted(pids)))} exited without unregistering"
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
