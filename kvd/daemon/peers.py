"""Handshakes with peer daemons, both ways, and what they leave behind.

As a reader, ``peer_for`` handshakes with a remote engine once, caches its
metadata (and, on one host, maps its memory), and does it again only after
a restart on either side. As an owner, ``handshake`` answers a reader: both
sides refuse pairs that cannot work (``kvd.core.pairing``), naming both
values, and the owner issues the secret the reader's data connections must
present (``kvd.core.owner``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field

import grpc

from kvd.core import errors
from kvd.core.engine_meta import EngineMeta, fingerprint
from kvd.core.errors import FailedPrecondition, InvalidArgument, KvdError, Unavailable
from kvd.core.leases import RankKey
from kvd.core.pairing import check_compatible
from kvd.core.relayout import GroupTensors
from kvd.core.requests import Introduction, RankMemory, TransferParams
from kvd.core.spec import MAX_EPOCH, check_engine_id
from kvd.daemon.config import DaemonConfig
from kvd.daemon.metrics import Metrics
from kvd.daemon.outbound import PeerChannels
from kvd.daemon.publisher import Publisher
from kvd.daemon.registry import Registry
from kvd.regions import MappedRegion, check_intact, close_later, map_regions
from kvd.transport.samehost import LocalSource
from kvd.transport.tcp_client import TcpDataClient

log = logging.getLogger("kvd.daemon")


@dataclass
class Peer:
    meta: EngineMeta
    address: str
    local_version: int  # our registration version when we handshook
    # Same host: the owner's ranks, mapped here, so reads are plain copies.
    local_sources: dict[RankKey, LocalSource] = field(default_factory=dict)
    mapped: list[MappedRegion] = field(default_factory=list)
    stale: bool = False  # its same-host memory was let go: the next pull handshakes again

    def close(self) -> None:
        self.local_sources.clear()
        for r in self.mapped:
            r.close()
        self.mapped.clear()



class Handshakes:
    def __init__(self, config: DaemonConfig, registry: Registry, publisher: Publisher, metrics: Metrics, channels: PeerChannels,
                 data_client: TcpDataClient) -> None:
        self.config = config
        self.registry = registry
        self.publisher = publisher  # as the owner: a reader's handshake joins it
        self.metrics = metrics
        self.channels = channels
        self.data_client = data_client
        self.peers: dict[str, Peer] = {}  # engines we read from, by engine id
        self.last_used: dict[str, float] = {}  # by engine id: when a pull last asked for it, or was under way
        self._locks: dict[str, asyncio.Lock] = {}
        self.slots = asyncio.Semaphore(config.max_pending_handshakes)  # as the callee

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()

    def _introduce(self, memory: tuple[RankMemory, ...] = (), data_token: bytes = b"") -> Introduction:
        mine = self.registry.engine_meta()
        return Introduction(mine, fingerprint(mine.model, mine.ranks[0].groups if mine.ranks else ()), memory, data_token)

    def handshake(self, caller: Introduction) -> Introduction:
        """A peer introduces itself (it wants to read from us)."""
        theirs = caller.meta
        check_engine_id("caller.engine_id", theirs.engine_id)
        if theirs.engine_id == self.config.engine_id:
            raise InvalidArgument("caller.engine_id", theirs.engine_id, "must name another engine")
        if not 1 <= len(theirs.epoch) <= MAX_EPOCH:
            raise InvalidArgument("caller.epoch", theirs.epoch, f"must be 1-{MAX_EPOCH} characters (a daemon's epoch is 32 hex digits)")
        mine = self.registry.engine_meta()
        try:
            check_compatible(mine, theirs)
        except KvdError:
            self.metrics.handshakes.labels("callee", "refused").inc()
            raise
        with self.publisher.lock:
            data_token = self.publisher.owner.reader_joined(theirs, time.monotonic()).data_token
            self.metrics.readers.set(len(self.publisher.owner.readers))
        self.metrics.handshakes.labels("callee", "ok").inc()
        same_host = self.config.same_host != "off" and theirs.host_id == self.registry.host_id
        log.info("handshake from engine=%s epoch=%s tp=%d pp=%d same_host=%s", theirs.engine_id, theirs.epoch[:8], theirs.tp_size, theirs.pp_size, same_host)
        memory = tuple(RankMemory(k[0], k[1], r.sources, tuple(r.groups), r.generation) for k, r in self.registry.by_rank.items()) if same_host else ()
        return self._introduce(memory, data_token)

    def drop_peer(self, engine_id: str) -> Peer | None:
        """Forget a remote engine's handshake (and unmap its same-host regions)."""
        peer = self.peers.pop(engine_id, None)
        if peer is not None and peer.mapped and not peer.stale:  # a stale one's are being unmapped already
            close_later(peer.close)
        return peer

    async def peer_for(self, params: TransferParams) -> Peer:
        """The remote engine's metadata, handshaking once and again only after a
        restart on either side."""
        eid = params.remote_engine_id
        self.last_used[eid] = time.monotonic()
        lock = self._locks.setdefault(eid, asyncio.Lock())
        async with lock:
            peer = self.peers.get(eid)
            if (peer is not None and not peer.stale and peer.address == params.remote_address and peer.meta.epoch == params.remote_epoch
                    and peer.local_version == self.registry.version):
                return peer
            mine = self._introduce()
            t0 = time.perf_counter()
            last: Exception | None = None
            for attempt in range(self.config.handshake_retries):
                try:
                    callee = await self.channels.handshake(params.remote_address, mine, timeout=10)
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                        self.metrics.handshakes.labels("caller", "refused").inc()
                        raise errors.from_code(e.code().name, f"handshake with {eid!r} at {params.remote_address}: {e.details()}") from None
                    last = e
                    await asyncio.sleep(0.1 * 2**attempt)
            else:
                self.metrics.handshakes.labels("caller", "unreachable").inc()
                raise Unavailable(f"handshake with {eid!r} at {params.remote_address} failed: {last}")
            theirs = callee.meta
            if theirs.engine_id != eid:
                raise FailedPrecondition(f"{params.remote_address} serves engine {theirs.engine_id!r}, not remote_engine_id={eid!r}")
            check_compatible(mine.meta, theirs)
            self.metrics.handshake_seconds.observe(time.perf_counter() - t0)
            self.metrics.handshakes.labels("caller", "ok").inc()
            peer = Peer(theirs, params.remote_address, self.registry.version)
            if self.config.same_host != "off" and theirs.host_id == self.registry.host_id:
                if callee.memory_refused:
                    log.warning("same-host path to engine=%s unavailable, using TCP: %s", eid, callee.memory_refused)
                else:
                    await self._map_same_host(peer, callee.memory)
            self.drop_peer(eid)
            self.data_client.set_token(theirs.data_address, callee.data_token)
            self.peers[eid] = peer
            return peer

    async def forget(self, engine_id: str, for_good: bool = False) -> Peer | None:
        """Drop an engine's handshake and the connections pooled to it (it
        may have restarted); ``for_good``: it is not read from any more, and
        the data client keeps nothing of it. The peer dropped, if any."""
        peer = self.drop_peer(engine_id)
        if peer is not None:
            await self.data_client.forget(peer.meta.data_address, for_good=for_good)
        return peer

    async def forget_idle(self, now: float, busy: set[str]) -> None:
        """Forget the engines not read from for ``peer_idle_seconds`` by
        ``now`` (``busy``: those a pull is queued for or under way from, in
        use now): an engine scaled away never fails a pull, so nothing else
        would unmap its memory (which a mapping here keeps from the host,
        however long ago it exited) or close the connections pooled to it.
        A pull from one later handshakes again."""
        for eid in busy:
            self.last_used[eid] = now
        for eid, at in list(self.last_used.items()):
            if now - at < self.config.peer_idle_seconds or self._in_use(eid, busy):
                continue
            del self.last_used[eid]
            self._locks.pop(eid, None)
            mapped = len(self.peers[eid].mapped) if eid in self.peers else 0  # counted before the peer is closed
            if await self.forget(eid, for_good=True) is not None:
                log.info("forgot engine=%s: not read from for %gs (%d same-host regions unmapped)", eid, self.config.peer_idle_seconds, mapped)

    def drop_removed(self, busy: set[str]) -> None:
        """Unmap the same-host memory of the engines whose worker let a
        shared-memory region go (its file removed: the worker ended, or its
        process died and its daemon removed what it left): only this mapping
        would keep those pages from the host, until the engine went idle. Not
        while a pull reads from it (``busy``) or a handshake is under way. The
        peer stays known, stale (its connections are closed when it goes idle,
        as any peer's); a later pull handshakes again, and maps what is
        registered then (if a worker removed files it still serves from, that
        mapping fails and the reads go over TCP)."""
        for eid, peer in self.peers.items():
            if peer.stale or self._in_use(eid, busy):
                continue
            gone = next((r.region_id for r in peer.mapped if r.removed()), None)  # a stat each, until one is gone
            if gone is not None:
                log.info("unmapping engine=%s's same-host memory (%d regions): its region %s was removed (its worker ended)",
                         eid, len(peer.mapped), gone)
                peer.stale = True
                close_later(peer.close)

    def _in_use(self, engine_id: str, busy: set[str]) -> bool:
        """A pull is queued for or under way from it (``busy``), or a handshake with it (its lock held)."""
        lock = self._locks.get(engine_id)
        return engine_id in busy or (lock is not None and lock.locked())

    async def _map_same_host(self, peer: Peer, memory: tuple[RankMemory, ...]) -> None:
        """Map the owner's regions, in a thread (mapping faults in every page:
        seconds for a real cache); on any failure fall back to TCP."""
        try:
            await asyncio.to_thread(_map_owner, peer, memory)
            log.info("same-host path to engine=%s: %d ranks mapped", peer.meta.engine_id, len(peer.local_sources))
        except KvdError as e:
            log.warning("same-host path to engine=%s unavailable, using TCP: %s", peer.meta.engine_id, e.message)
            peer.close()


def _map_owner(peer: Peer, memory: tuple[RankMemory, ...]) -> None:
    """Each of the owner's ranks mapped into ``peer`` (not yet shared with
    the loop), as a source to copy from."""
    for rank in memory:
        mapped = map_regions(rank.regions)
        peer.mapped.extend(mapped.values())
        views = {rid: m.tensor for rid, m in mapped.items()}
        groups = {g.group_id: GroupTensors.build(g, views) for g in rank.groups}
        whose = f"engine {peer.meta.engine_id!r} tp{rank.tp_rank}/pp{rank.pp_rank}'s"
        peer.local_sources[(rank.tp_rank, rank.pp_rank)] = LocalSource(groups, rank.registration,
                                                                       functools.partial(check_intact, list(mapped.values()), whose))
