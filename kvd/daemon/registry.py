"""The engine's registered workers, as one daemon holds them.

``Registry`` checks a worker's registration against the ranks already
here, maps its memory (off the loop), commits it, and ends it when the
worker leaves, restarts or dies. What else starts or ends with a rank (its
pulls, its publications, its finished sets) is told through the
``rank_joined`` and ``rank_ended`` hooks, so the registry knows nothing of
either side. It also
answers what every side asks: who a worker is (``registered``), whether a
caller speaks for this engine, and this engine as peers see it
(``engine_meta``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Iterator, Sequence

from kvd import __version__
from kvd.core.engine_meta import (
    LAYER_STREAM,
    PER_READER_ACKS,
    WIRE_VERSION,
    EngineLayout,
    EngineMeta,
)
from kvd.core.errors import (
    FailedPrecondition,
    Incompatible,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kvd.core.leases import RankKey
from kvd.core.relayout import GroupTensors, sharing_groups
from kvd.core.requests import Region, Registered, Registering
from kvd.core.spec import GroupSpec, ModelInfo, WorkerId
from kvd.core.topology import heads_of_rank
from kvd.daemon.metrics import Metrics
from kvd.daemon.reaper import Leftovers
from kvd.daemon.registration import Registration, check_token, shm_names, token_for
from kvd.regions import MappedRegion, close_later, map_regions, shm
from kvd.transport.nixl import NixlAgent

log = logging.getLogger("kvd.daemon")

RankEnded = Callable[[RankKey, str], None]  # (rank, why): its worker left, restarted or died
RankJoined = Callable[[Registration], None]


class Registry:
    def __init__(self, engine_id: str, epoch: str, host_id: str, data_address: Callable[[], str], metrics: Metrics,
                 nixl: NixlAgent | None) -> None:
        self.engine_id = engine_id
        self.epoch = epoch
        self.host_id = host_id
        self._data_address = data_address  # known once the data server is bound
        self._metrics = metrics
        self._nixl = nixl
        self.by_rank: dict[RankKey, Registration] = {}
        self.version = 0  # changes whenever a worker (un)registers: what peers saw may be stale
        self.rank_ended: list[RankEnded] = []
        self.rank_joined: list[RankJoined] = []
        self.rank_retired: list[RankEnded] = []  # its worker is gone; the registration lingers (``retire``)
        self._generation = 0
        self._meta_cache: tuple[int, EngineMeta] | None = None
        self._registering = asyncio.Lock()
        self.leftovers = Leftovers()  # files of registrations ended while their creator held them

    def __iter__(self) -> Iterator[Registration]:
        return iter(self.by_rank.values())

    def __len__(self) -> int:
        return len(self.by_rank)

    def get(self, rank: RankKey) -> Registration | None:
        return self.by_rank.get(rank)

    def sizes(self) -> tuple[int, int] | None:
        """(tp_size, pp_size) of the registered engine (None before any worker)."""
        w = next((r.worker for r in self.by_rank.values()), None)
        return (w.tp_size, w.pp_size) if w is not None else None

    @property
    def world(self) -> int:
        """tp_size x pp_size of the registered engine (1 before any worker)."""
        w = next((r.worker for r in self.by_rank.values()), None)
        return w.tp_size * w.pp_size if w is not None else 1

    # ------------------------------------------------------------ registering

    async def register(self, req: Registering, caller_uid: int | None = None) -> Registered:
        """Register a worker; ``caller_uid``: the local user calling (``caller_uid.py``),
        whose shared-memory files alone it may name (None: not known; root: any)."""
        # One at a time: each is checked against the ranks registered before
        # it, and commits only after its mapping, which runs off the loop.
        async with self._registering:
            worker, model, groups = self._check(req)
            alive = self._watch_alive(req, worker, caller_uid)
            try:
                mapped, handles = await self._mapped(req.regions, caller_uid or None)
                try:
                    tensors = [GroupTensors.build(g, {rid: r.tensor for rid, r in mapped.items()}) for g in groups]
                    # Which groups overlay one another's blocks: exact, so up to a few ms a layer, off the loop.
                    sharing = await asyncio.to_thread(sharing_groups, tensors)
                except BaseException:
                    self._unmap(mapped, handles)
                    raise
            except BaseException:
                if alive is not None:
                    alive.close()
                raise
            return self._commit(req, worker, model, groups, mapped, handles, tensors, sharing, alive)

    @staticmethod
    def _watch_alive(req: Registering, worker: WorkerId, caller_uid: int | None) -> shm.CreatorWatch | None:
        """The page the worker's process holds locked while it lives (opened, not
        mapped: a few syscalls). One this daemon cannot open at all (it does not
        share the worker's /dev/shm, or may not read it) leaves the worker
        registered as before the token, watched by its memory alone."""
        if not req.alive_shm:
            return None
        try:
            return shm.CreatorWatch.open(req.alive_shm, "alive_shm", caller_uid or None)
        except OSError as e:
            log.warning("worker=%s registers without its alive token alive_shm=%r: %s here; a kill is seen only where its memory "
                        "tells (does this daemon share the worker's /dev/shm?)", worker, req.alive_shm, e.strerror)
            return None

    async def _mapped(self, regions: Sequence[Region], owner_uid: int | None) -> tuple[dict[str, MappedRegion], list[object]]:
        """``_map`` in a thread. A call cancelled meanwhile (its client's deadline passed, or it
        went away: mapping a real cache takes seconds) cannot stop the thread, and would leave
        what it maps to nobody, its NIXL registrations for good: that is undone when it ends."""
        job = asyncio.ensure_future(asyncio.to_thread(self._map, regions, owner_uid))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(self._unmap_orphan)
            raise

    def _unmap_orphan(self, job: asyncio.Future[tuple[dict[str, MappedRegion], list[object]]]) -> None:
        if not job.cancelled() and job.exception() is None:
            mapped, handles = job.result()
            close_later(lambda: self._unmap(mapped, handles))  # off the loop, as _release: seconds for a real cache
            log.info("unmapping the regions of a registration cancelled while they were mapped")

    def _map(self, regions: Sequence[Region], owner_uid: int | None) -> tuple[dict[str, MappedRegion], list[object]]:
        """In a thread: map a worker's regions and register their host memory
        with NIXL, which reads and writes only registered memory (pinning it
        for RDMA takes long too); on any failure, nothing stays either."""
        mapped = map_regions(regions, owner_uid, watch=True)
        handles: list[object] = []
        try:
            if self._nixl is not None:
                for r in mapped.values():
                    if r.tensor.device.type == "cpu":
                        handles.append(self._nixl.register(r.tensor.data_ptr(), r.size))
        except BaseException:
            self._unmap(mapped, handles)
            raise
        return mapped, handles

    def _unmap(self, mapped: dict[str, MappedRegion], handles: Sequence[object]) -> None:
        if self._nixl is not None:
            for h in handles:
                self._nixl.deregister(h)
        for r in mapped.values():
            r.close()

    def _check(self, req: Registering) -> tuple[WorkerId, ModelInfo, list[GroupSpec]]:
        worker = req.worker
        self._check_own(worker)
        model = req.model
        for key, other in self.by_rank.items():
            if key == (worker.tp_rank, worker.pp_rank):
                continue
            if (other.worker.tp_size, other.worker.pp_size) != (worker.tp_size, worker.pp_size):
                raise InvalidArgument("worker.tp_size", (worker.tp_size, worker.pp_size), f"differs from rank {key}'s (tp_size, pp_size)={(other.worker.tp_size, other.worker.pp_size)}")
            if other.model != model:
                raise InvalidArgument("model", model, f"differs from rank {key}'s {other.model}")
        check_token(req.worker_token)
        if not req.groups:
            raise InvalidArgument("groups", 0, "must register at least one KV cache group")
        groups = list(req.groups)
        ids = [g.group_id for g in groups]
        if ids != list(range(len(groups))):
            raise InvalidArgument("groups.group_id", ids, "must be 0..n-1 in order")
        for g in groups:
            bad = [i for i in g.layer_indices if i >= model.num_layers]
            if bad:
                raise InvalidArgument(f"groups[{g.group_id}].layers.layer_index", bad[0], f"is not below model.num_layers={model.num_layers}")
            if g.spec.state:
                # A state part splits by its own heads: equally, so every rank holds as many.
                theirs = next((o.groups[g.group_id].spec.num_kv_heads for k, o in self.by_rank.items()
                               if k != (worker.tp_rank, worker.pp_rank) and g.group_id < len(o.groups) and o.groups[g.group_id].spec.state), None)
                if theirs is not None and theirs != g.spec.num_kv_heads:
                    raise InvalidArgument(f"groups[{g.group_id}].spec.num_kv_heads", g.spec.num_kv_heads, f"differs from another rank's {theirs} for this state group")
                continue
            if model.total_num_kv_heads <= 0:
                raise InvalidArgument("model.total_num_kv_heads", model.total_num_kv_heads, f"must be positive: groups[{g.group_id}] is a {g.kind} group")
            try:
                want = heads_of_rank(worker.tp_rank, worker.tp_size, model.total_num_kv_heads, g.spec.use_mla).count
            except Incompatible as e:
                raise InvalidArgument("worker.tp_size", worker.tp_size, f"cannot split model.total_num_kv_heads={model.total_num_kv_heads}: {e.message}") from None
            if g.spec.num_kv_heads != want:
                raise InvalidArgument(f"groups[{g.group_id}].spec.num_kv_heads", g.spec.num_kv_heads, f"should be {want} for tp_rank {worker.tp_rank} of {worker.tp_size} with {model.total_num_kv_heads} KV heads")
        return worker, model, groups

    def _commit(self, req: Registering, worker: WorkerId, model: ModelInfo, groups: list[GroupSpec],
                mapped: dict[str, MappedRegion], handles: list[object], tensors: list[GroupTensors],
                sharing: tuple[tuple[int, int], ...], alive: shm.CreatorWatch | None = None) -> Registered:
        key = (worker.tp_rank, worker.pp_rank)
        old = self.by_rank.pop(key, None)
        token = token_for(req.worker_token, old)
        if old is not None:
            # The worker restarted: its old memory is gone, so is anything published from it,
            # and its pulls (they would land in memory it no longer owns).
            self._ended(key, "worker re-registered")
            self._release(old, unlink=bool(old.gone))  # a gone worker's regions: nobody else unlinks them
        self._generation += 1
        self.version += 1
        reg = Registration(worker, model, mapped, groups, tensors, self._generation, req.regions, token, handles, sharing=sharing, alive=alive)
        self.by_rank[key] = reg
        for hook in self.rank_joined:
            hook(reg)
        self._update_metrics()
        log.info("registered worker=%s regions=%d bytes=%d groups=%d layers=%d", worker, len(mapped), reg.nbytes, len(groups), sum(len(g.layers) for g in groups))
        return Registered(reg.generation, reg.nbytes, self.epoch, reg.worker_token)

    def unregister(self, worker: WorkerId, token: bytes | None = None) -> None:
        key = self.registered(worker, token).worker
        self.end((key.tp_rank, key.pp_rank), "worker unregistered")

    def end(self, rank: RankKey, reason: str, *, unlink: bool = False) -> None:
        """The worker left: what it had ends with ``reason``, its memory is
        unmapped, and with ``unlink`` (its creator is gone) removed. The
        hooks run once it is no longer registered, so a finished-set stream
        woken by them sees its registration gone and ends (a read arriving
        meanwhile is refused as for an unregistered rank)."""
        reg = self.by_rank.pop(rank)
        self._ended(rank, reason)
        self._release(reg, unlink=unlink)
        self.version += 1
        self._update_metrics()

    def _ended(self, rank: RankKey, reason: str) -> None:
        for hook in self.rank_ended:
            hook(rank, reason)

    def _release(self, reg: Registration, *, unlink: bool = False) -> None:
        if not unlink:
            # Its creator may still be alive (it unregistered, or registered the rank
            # again in new memory) or may be dying: its files are watched until it lets go.
            self.leftovers.watch(reg.watches())

        def unmap() -> None:
            reg.tensors.clear()  # views: a region unmaps when its last one goes (regions/shm.py, close)
            self._unmap(reg.regions, reg.nixl_handles)
            if reg.alive is not None:
                reg.alive.close()
            if unlink:
                for name in shm_names(reg):
                    shm.unlink_name(name)

        close_later(unmap)

    def live_ranks(self) -> set[RankKey]:
        """The ranks whose worker is still there (a retired one lingers until its reads end)."""
        return {k for k, reg in self.by_rank.items() if not reg.gone}

    def live_registrations(self) -> dict[RankKey, Registration]:
        """Each live rank's registration: the reaper watches for its worker's end."""
        return {k: reg for k, reg in self.by_rank.items() if not reg.gone}

    def retire(self, rank: RankKey, reason: str, now: float) -> None:
        """The rank's worker exited without unregistering: it accepts nothing
        new (its pulls end, since they would land in memory nobody owns), but
        what it published stays readable, its memory mapped, until
        ``end_retired`` ends it."""
        reg = self.by_rank[rank]
        reg.gone, reg.gone_at = reason, now
        for hook in self.rank_retired:
            hook(rank, reason)

    def end_retired(self, now: float, held: Callable[[RankKey], bool], grace_s: float) -> None:
        """End each retired rank that no publication holds any more, or whose
        grace is over; its regions are unlinked (their creator is gone)."""
        for rank, reg in list(self.by_rank.items()):
            if reg.gone and (not held(rank) or now - reg.gone_at >= grace_s):
                self.end(rank, reg.gone, unlink=True)

    def close(self) -> None:
        for reg in self.by_rank.values():
            reg.close()
            if reg.gone:  # its creator cannot unlink them
                for name in shm_names(reg):
                    shm.unlink_name(name)
        self.by_rank.clear()

    def _update_metrics(self) -> None:
        self._metrics.regions.set(sum(len(r.regions) for r in self.by_rank.values()))
        self._metrics.region_bytes.set(sum(r.nbytes for r in self.by_rank.values()))

    # ------------------------------------------------------------ who asks

    def _check_own(self, worker: WorkerId) -> None:
        if worker.engine_id != self.engine_id:
            raise InvalidArgument("worker.engine_id", worker.engine_id, f"does not match this daemon's engine {self.engine_id!r}")

    def registered(self, worker: WorkerId, token: bytes | None = None) -> Registration:
        """The worker's registration; with ``token``, only for the worker itself."""
        self._check_own(worker)
        reg = self.by_rank.get((worker.tp_rank, worker.pp_rank))
        if reg is None:
            raise NotFound(f"worker {worker} is not registered with this daemon")
        if reg.gone:
            raise NotFound(f"worker {worker} is gone ({reg.gone}): what it published is served until read, nothing new is accepted")
        if token is not None and not hmac.compare_digest(token, reg.worker_token):
            raise PermissionDenied(f"only the registered worker {worker} may act for its engine and rank (kvd-worker-token missing or wrong)")
        return reg

    def check_engine(self, engine_id: str) -> None:
        if engine_id != self.engine_id:
            raise InvalidArgument("engine_id", engine_id, f"is not this daemon's engine {self.engine_id!r}")

    def check_engine_token(self, engine_id: str, token: bytes) -> None:
        """Engine-level calls need the token of some worker of this engine."""
        self.check_engine(engine_id)
        if not any(hmac.compare_digest(token, r.worker_token) for r in self.by_rank.values()):
            raise PermissionDenied(f"engine-level calls for {engine_id!r} need a registered worker's kvd-worker-token")

    def check_peer_engine(self, engine_id: str) -> None:
        """A peer's call about a publication (abort, renew, resolve) names the
        engine it means: one that reached the wrong daemon changes nothing here."""
        if engine_id != self.engine_id:
            raise FailedPrecondition(f"engine_id={engine_id!r} names another engine: this daemon serves engine_id={self.engine_id!r}")

    def engine_meta(self) -> EngineMeta:
        """This engine as peers see it; rebuilt only when a worker (un)registers."""
        cached = self._meta_cache
        if cached is not None and cached[0] == self.version:
            return cached[1]
        regs = list(self.by_rank.values())
        if not regs:
            raise Unavailable(f"engine {self.engine_id!r} has no registered workers yet")
        w = regs[0].worker
        meta = EngineMeta(
            engine_id=self.engine_id, epoch=self.epoch, host_id=self.host_id, data_address=self._data_address(),
            tp_size=w.tp_size, pp_size=w.pp_size, model=regs[0].model,
            ranks=tuple(EngineLayout(r.worker.tp_rank, r.worker.pp_rank, tuple(r.groups)) for r in sorted(regs, key=lambda r: (r.worker.pp_rank, r.worker.tp_rank))),
            features=(LAYER_STREAM, PER_READER_ACKS), kvd_version=__version__, wire_version=WIRE_VERSION,
        )
        self._meta_cache = (self.version, meta)
        return meta
