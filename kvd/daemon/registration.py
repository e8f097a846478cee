"""A worker's registration as the daemon holds it: its mapped regions, its
KV cache groups as tensors over them, and its token; and the host id that
tells two daemons they share memory."""

from __future__ import annotations

import hmac
import secrets
import socket
from dataclasses import dataclass, field

from kvd.core.aggregate import PushLog
from kvd.core.errors import InvalidArgument
from kvd.core.relayout import GroupTensors
from kvd.core.requests import Region
from kvd.core.spec import GroupSpec, ModelInfo, WorkerId
from kvd.regions import MappedRegion, check_intact, shm


@dataclass
class Registration:
    worker: WorkerId
    model: ModelInfo
    regions: dict[str, MappedRegion]
    groups: list[GroupSpec]
    tensors: list[GroupTensors]
    generation: int
    sources: tuple[Region, ...]  # as the worker described them: same-host peers map them too
    worker_token: bytes = b""
    nixl_handles: list[object] = field(default_factory=list)
    pushed: PushLog = field(default_factory=PushLog)  # what WatchFinished sent this registration
    # Positions of groups overlaid on the same memory: no block id may be given to two of them.
    sharing: tuple[tuple[int, int], ...] = ()
    # Why its worker is gone (exited without unregistering), and since when (monotonic):
    # what it published is still served for a grace, nothing new is accepted.
    gone: str = ""
    gone_at: float = 0.0
    # The page its process holds locked while it lives (``RegisterRequest.alive_shm``), or None.
    alive: shm.CreatorWatch | None = None

    def watches(self) -> list[shm.CreatorWatch]:
        """New watches (their own descriptors) on every file its worker holds
        locked: its regions seen locked when mapped, and its alive token."""
        found = [w for r in self.regions.values() if isinstance(r, shm.ShmRegion) and (w := r.watch_creator()) is not None]
        return found + ([self.alive.dup()] if self.alive is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.regions.values())

    def check_intact(self) -> None:
        """Raise where a region shrank since it was mapped (``regions.check_intact``)."""
        check_intact(self.regions.values(), f"worker {self.worker}'s")

    def close(self) -> None:
        self.tensors.clear()
        for r in self.regions.values():
            r.close()
        if self.alive is not None:
            self.alive.close()


def shm_names(reg: Registration) -> list[str]:
    """Its files in /dev/shm: its shared-memory regions, and its alive token."""
    return [r.name for r in reg.regions.values() if isinstance(r, shm.ShmRegion)] + ([reg.alive.name] if reg.alive is not None else [])


def host_id() -> str:
    """Same value for every daemon on one host (and kernel boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


TOKEN_BYTES = 32  # a worker token, as the daemon issues it


def check_token(token: bytes) -> None:
    """A token a worker proposes as it registers again (one a daemon issued it before), or none."""
    if token and len(token) != TOKEN_BYTES:
        raise InvalidArgument("worker_token", f"{len(token)} bytes", f"must be the {TOKEN_BYTES} bytes a daemon issued, or empty")


def token_for(proposed: bytes, old: Registration | None) -> bytes:
    """The token of a new registration. A worker registering again may keep the
    one it had (vLLM's scheduler learned it once, at startup): with a restarted
    daemon (nothing registered for its rank here), or the same token as the
    registration it replaces. Otherwise a new one."""
    if proposed and (old is None or hmac.compare_digest(proposed, old.worker_token)):
        return proposed
    return secrets.token_bytes(TOKEN_BYTES)
