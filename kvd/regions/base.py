"""The region interface and the dispatcher over region kinds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from kvd.core.errors import FailedPrecondition, InvalidArgument
from kvd.core.requests import CudaIpcSource, Region, ShmSource


class MappedRegion(Protocol):
    region_id: str
    kind: str  # "shm" | "cuda_ipc"
    size: int
    tensor: torch.Tensor  # flat uint8, on CPU or a CUDA device

    def close(self) -> None: ...

    def backing_bytes(self) -> int:
        """Bytes of the memory behind the mapping now (it may have shrunk since)."""
        ...

    def removed(self) -> bool:
        """Whether the memory's maker let it go (a shared-memory file
        unlinked): then nothing but mappings keeps its pages from the host."""
        ...

    def creator_gone(self) -> bool:
        """Whether the process that made the memory has let go of it (its
        lock on a shared-memory file is free: it exited, from any pid
        namespace). False where that cannot be seen."""
        ...


REGION_ID_MAX = 128


def map_region(region: Region, owner_uid: int | None = None, *, watch: bool = False) -> MappedRegion:
    """Map a worker's region descriptor, checking it is reachable and big enough
    (and, with ``owner_uid``, that a shared-memory file belongs to that user);
    ``watch``: its registration's daemon, which watches for its creator's end."""
    rid = region.region_id
    if not rid or len(rid) > REGION_ID_MAX or not all(c.isalnum() or c in "-_." for c in rid):
        raise InvalidArgument("region.region_id", rid, f"must be 1-{REGION_ID_MAX} chars of [A-Za-z0-9-_.]")
    if region.size_bytes <= 0:
        raise InvalidArgument(f"regions[{rid}].size_bytes", region.size_bytes, "must be positive")
    source = region.source
    if isinstance(source, ShmSource):
        from kvd.regions import shm

        return shm.ShmRegion.open(rid, source.name, region.size_bytes, owner_uid, watch=watch)
    if isinstance(source, CudaIpcSource):
        from kvd.regions import cuda_ipc

        return cuda_ipc.CudaIpcRegion.open(rid, source, region.size_bytes)
    raise InvalidArgument(f"regions[{rid}].source", None, "must be shm or cuda_ipc")


def map_regions(regions: Iterable[Region], owner_uid: int | None = None, *, watch: bool = False) -> dict[str, MappedRegion]:
    """Map every region, by id; on any failure none stays mapped. With
    ``owner_uid`` (the registering worker's), each shared-memory file must
    belong to that user: a worker registers only its own memory.

    Mapping faults in every page of shared memory (about 70 ms a GiB on a
    2-core host, so seconds for a real cache): callers on an event loop run
    this in a thread, or the daemon answers nobody meanwhile."""
    mapped: dict[str, MappedRegion] = {}
    try:
        for region in regions:
            if region.region_id in mapped:
                raise InvalidArgument("regions.region_id", region.region_id, "is listed twice")
            mapped[region.region_id] = map_region(region, owner_uid, watch=watch)
    except BaseException:
        for r in mapped.values():
            r.close()
        raise
    return mapped


def check_intact(regions: Iterable[MappedRegion], whose: str) -> None:
    """Refuse to touch regions whose memory shrank after they were mapped.

    A shared-memory file truncated under a mapping turns the next access
    past its end into SIGBUS, which kills the whole daemon (copies by torch
    or ``memmove`` fault; only the kernel's socket copies fail cleanly). One
    ``fstat`` a region before each read; a truncation during the copy itself
    is not caught."""
    for r in regions:
        now = r.backing_bytes()
        if now < r.size:
            raise FailedPrecondition(f"{whose} region {r.region_id!r} shrank to {now} bytes after it was registered with {r.size}; "
                                     f"the worker must register again")
