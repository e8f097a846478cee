"""Shared memory that outlives its engine: found and removed.

A worker that is killed (SIGKILL, the OOM killer) never unregisters, and the
KV cache regions it made in /dev/shm stay behind, owned by a dead pid; a node
that restarts engines a few times fills /dev/shm, and then every engine on it
fails at start. ``kvd.caches`` names each region it makes for its creator
(pid and pid namespace, ``shm.OWNED_NAME``), so a daemon in the same pid
namespace can tell. ``Reaper`` checks, once a second, the creators of every
registered worker's regions: a registration whose creators are all gone ends
as an unregister would (its pulls and publications end, with the reason),
and its regions are unlinked once the daemon has unmapped them. At start,
``remove_orphans`` removes regions whose creator is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from kvd.regions import shm

log = logging.getLogger("kvd.daemon")

CHECK_SECONDS = 1.0


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
    """Ends registrations whose worker is gone (``end(rank, reason)``)."""

    def __init__(self, registered_names: Callable[[], Mapping[tuple[int, int], list[str]]], end: Callable[[tuple[int, int], str], None]) -> None:
        self.registered_names = registered_names  # rank -> the shm names of its regions
        self.end = end
        self.namespace = shm.pid_namespace()

    def check(self) -> list[tuple[int, int]]:
        """End each registration whose regions' creators have all exited; the ranks ended."""
        ended = []
        for rank, names in list(self.registered_names().items()):
            pids = creators(names, self.namespace)
            if pids and not any(shm.pid_alive(p) for p in pids):
                reason = f"worker gone: pid {', '.join(map(str, sorted(pids)))} exited without unregistering"
                log.warning("ending registration of rank tp%d/pp%d: %s", rank[0], rank[1], reason)
                self.end(rank, reason)
                ended.append(rank)
        return ended

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            self.check()
