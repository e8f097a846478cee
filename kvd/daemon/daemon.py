"""The daemon: one engine's registrations, peers and finished sets.

``Daemon`` is the composition: it owns what both sides share (registered
workers, the handshakes with peers, metrics, the finished-set boxes) and
holds the two sides, ``Publisher`` (prefill: publications and reads of them)
and ``Puller`` (decode: pulls). Every public method is what one RPC or
data-plane event asks for; none blocks the loop on I/O.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Sequence

import grpc

from kvd import __version__
from kvd.auth import AuthConfig
from kvd.convert import (
    group_from_pb,
    model_from_pb,
    worker_from_pb,
    worker_to_pb,
)
from kvd.core.aggregate import EngineFinishedHub, Outcome, WorkerFinished
from kvd.core.errors import (
    FailedPrecondition,
    Incompatible,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kvd.core.leases import Ended, PublicationTable, RankKey
from kvd.core.relayout import GroupTensors, sharing_groups
from kvd.core.session import Hello
from kvd.core.spec import (
    LAYER_STREAM,
    WIRE_VERSION,
    EngineLayout,
    EngineMeta,
    GroupSpec,
    ModelInfo,
    WorkerId,
    check_request_id,
)
from kvd.core.topology import heads_of_rank
from kvd.daemon.config import DaemonConfig
from kvd.daemon.metrics import ActiveClock, Metrics
from kvd.daemon.peers import Handshakes
from kvd.daemon.publisher import Publisher
from kvd.daemon.puller import Puller
from kvd.daemon.reaper import Reaper, remove_orphans
from kvd.daemon.registration import Registration, check_token, host_id, shm_names, token_for
from kvd.daemon.reports import AggregatorReports
from kvd.daemon.watchdog import LoopWatchdog
from kvd.proto import kvd_pb2 as pb
from kvd.regions import MappedRegion, close_later, map_regions, shm
from kvd.transport.nixl import NixlAgent
from kvd.transport.nixl import available as nixl_available
from kvd.transport.tcp_client import TcpDataClient
from kvd.transport.tcp_server import TcpDataServer

log = logging.getLogger("kvd.daemon")


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        WorkerId(config.engine_id)  # validates the id
        self.config = config
        self.auth = AuthConfig.load(config.auth, config.token_file, config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
        self.epoch = uuid.uuid4().hex
        self.host_id = host_id()
        self.metrics = Metrics()
        self.active_clock = ActiveClock(self.metrics.active_seconds)
        self.registrations: dict[RankKey, Registration] = {}
        self.finished: dict[RankKey, WorkerFinished] = {}
        self.publications = PublicationTable(config.lease_seconds, self.epoch)
        self.engine_hub = EngineFinishedHub()
        self._expected_override = 0
        self.reports = AggregatorReports(self)  # to (or, as the aggregator, from) the other nodes' daemons
        self._last_outcome_at = float("-inf")  # monotonic time of the newest outcome
        self._background: list[asyncio.Task[None]] = []
        self._watchdog: LoopWatchdog | None = None
        self.registration_version = 0
        self._meta_cache: tuple[int, EngineMeta] | None = None
        self._generation = 0
        self._registering = asyncio.Lock()
        self.draining = False
        self.streams_ending = False  # after the drain: push streams send what is left and end
        self.grpc_address = ""  # what peers dial for gRPC: set by the server once it is bound
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.handshakes = Handshakes(self)
        self.publisher = Publisher(self)
        self.puller = Puller(self)
        self.nixl = self._nixl_agent(config)
        self.data_server = TcpDataServer(self.publisher, config.host, config.data_port, tls=self.auth.data_plane_context(server=True),
                                         nixl=self.nixl, nixl_staging_bytes=config.nixl_staging_bytes)
        self.data_client = TcpDataClient(Hello(engine_id=config.engine_id, epoch=self.epoch, shared_token=self.auth.token),
                                         connections_per_peer=config.connections_per_peer, copy_threads=config.copy_threads,
                                         stall_timeout_s=config.stall_timeout_seconds, stream_wait_s=config.pull_timeout_seconds, on_relayout=self.metrics.relayout_seconds.inc,
                                         tls=self.auth.data_plane_context(server=False), nixl=self.nixl)

    def _nixl_agent(self, config: DaemonConfig) -> NixlAgent | None:
        if config.transport != "nixl":
            return None
        if self.auth.mode == "mtls":
            raise InvalidArgument("transport", "nixl", "cannot be used with auth: mtls (NIXL traffic is not encrypted)")
        why = nixl_available()
        if why:
            raise InvalidArgument("transport", "nixl", why)
        try:
            return NixlAgent(f"kvd-{config.engine_id}-{self.epoch[:8]}", config.nixl_progress_delay_us)
        except (ImportError, OSError) as e:
            raise InvalidArgument("transport", "nixl", f"NIXL failed to load: {e}") from None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.config.data_port = await self.data_server.start()
        remove_orphans()
        reaper = Reaper(self._registered_shm, lambda k, reason: self._end_registration(k, reason, unlink=True))
        self._background = [asyncio.create_task(self.publisher.sweep()), asyncio.create_task(self.puller.heartbeat()),
                            asyncio.create_task(self.reports.run()), asyncio.create_task(reaper.run())]
        self._watchdog = LoopWatchdog(asyncio.get_running_loop(), self.metrics.event_loop_lag)
        self._watchdog.start()

    @property
    def data_address(self) -> str:
        if self.config.data_advertise_address:
            return self.config.data_advertise_address
        return f"{self.config.advertise_host or self.config.host}:{self.config.data_port}"

    async def drain(self) -> None:
        """Stop new work; let in-flight pulls finish within the drain bound, then fail them."""
        self.draining = True
        tasks = [p.task for p in self.puller.pulls.values() if p.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.config.drain_seconds)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        # Report everything before exiting: give workers (and the aggregator)
        # a bounded time to collect what the drain produced.
        # Outcomes older than that bound were not read by now and will not be
        # (a box its engine never reads): they do not hold the exit up.
        start = time.monotonic()
        while (time.monotonic() < min(start, self._last_outcome_at) + self.config.drain_report_seconds
               and (self.reports.pending or any(b.sending or b.recving for b in self.finished.values()))):
            await asyncio.sleep(0.05)

    def end_streams(self) -> None:
        """After the drain: every push stream sends what is left and ends, so
        stopping the gRPC server does not wait out its grace on open streams."""
        self.streams_ending = True
        for box in self.finished.values():
            box.wake()
        for notify in list(self.engine_hub.subscribers):
            notify(WorkerFinished())  # empty: the stream's cue to end

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        for t in self._background:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.data_server.close()
        await self.data_client.close()
        if self.nixl is not None:
            self.nixl.close()
        for ch in self._channels.values():
            await ch.close()
        self.handshakes.close()
        for reg in self.registrations.values():
            reg.close()
        self.registrations.clear()

    # ------------------------------------------------------------ registration

    async def register(self, req: pb.RegisterRequest) -> pb.RegisterResponse:
        # One at a time: each is checked against the ranks registered before
        # it, and commits only after its mapping, which runs off the loop.
        async with self._registering:
            worker, model, groups = self._check_registration(req)
            mapped, handles = await asyncio.to_thread(self._map, req.regions)
            try:
                tensors = [GroupTensors.build(g, {rid: r.tensor for rid, r in mapped.items()}) for g in groups]
                # Which groups overlay one another's blocks: exact, so up to a few ms a layer, off the loop.
                sharing = await asyncio.to_thread(sharing_groups, tensors)
            except BaseException:
                self._unmap(mapped, handles)
                raise
            return self._commit_registration(req, worker, model, groups, mapped, handles, tensors, sharing)

    def _map(self, regions: Sequence[pb.Region]) -> tuple[dict[str, MappedRegion], list[object]]:
        """In a thread: map a worker's regions and register their host memory
        with NIXL, which reads and writes only registered memory (pinning it
        for RDMA takes long too); on any failure, nothing stays either."""
        mapped = map_regions(regions)
        handles: list[object] = []
        try:
            if self.nixl is not None:
                for r in mapped.values():
                    if r.tensor.device.type == "cpu":
                        handles.append(self.nixl.register(r.tensor.data_ptr(), r.size))
        except BaseException:
            self._unmap(mapped, handles)
            raise
        return mapped, handles

    def _unmap(self, mapped: dict[str, MappedRegion], handles: Sequence[object]) -> None:
        if self.nixl is not None:
            for h in handles:
                self.nixl.deregister(h)
        for r in mapped.values():
            r.close()

    def _check_registration(self, req: pb.RegisterRequest) -> tuple[WorkerId, ModelInfo, list[GroupSpec]]:
        worker = worker_from_pb(req.worker)
        if worker.engine_id != self.config.engine_id:
            raise InvalidArgument("worker.engine_id", worker.engine_id, f"does not match this daemon's engine {self.config.engine_id!r}")
        model = model_from_pb(req.model)
        for key, other in self.registrations.items():
            if key == (worker.tp_rank, worker.pp_rank):
                continue
            if (other.worker.tp_size, other.worker.pp_size) != (worker.tp_size, worker.pp_size):
                raise InvalidArgument("worker.tp_size", (worker.tp_size, worker.pp_size), f"differs from rank {key}'s (tp_size, pp_size)={(other.worker.tp_size, other.worker.pp_size)}")
            if other.model != model:
                raise InvalidArgument("model", model, f"differs from rank {key}'s {other.model}")
        check_token(req.worker_token)
        if not req.groups:
            raise InvalidArgument("groups", 0, "must register at least one KV cache group")
        groups = [group_from_pb(g, i) for i, g in enumerate(req.groups)]
        ids = [g.group_id for g in groups]
        if ids != list(range(len(groups))):
            raise InvalidArgument("groups.group_id", ids, "must be 0..n-1 in order")
        for g in groups:
            bad = [i for i in g.layer_indices if i >= model.num_layers]
            if bad:
                raise InvalidArgument(f"groups[{g.group_id}].layers.layer_index", bad[0], f"is not below model.num_layers={model.num_layers}")
            if g.spec.state:
                # A state part splits by its own heads: equally, so every rank holds as many.
                theirs = next((o.groups[g.group_id].spec.num_kv_heads for k, o in self.registrations.items()
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

    def _commit_registration(self, req: pb.RegisterRequest, worker: WorkerId, model: ModelInfo, groups: list[GroupSpec],
                             mapped: dict[str, MappedRegion], handles: list[object], tensors: list[GroupTensors],
                             sharing: tuple[tuple[int, int], ...]) -> pb.RegisterResponse:
        key = (worker.tp_rank, worker.pp_rank)
        old = self.registrations.pop(key, None)
        token = token_for(req.worker_token, old)
        if old is not None:
            # The worker restarted: its old memory is gone, so is anything published from it,
            # and its pulls (they would land in memory it no longer owns).
            self.puller.cancel_rank(key)
            self.publisher.abort_rank(key, "worker re-registered")
            self._release(old)
        self._generation += 1
        self.registration_version += 1
        reg = Registration(worker, model, mapped, groups, tensors, self._generation, list(req.regions), token, handles, sharing=sharing)
        self.registrations[key] = reg
        # The box outlives registrations; a stream the old registration opened sees it was replaced and ends.
        self.finished.setdefault(key, WorkerFinished()).wake()
        self.engine_hub.set_expected(self._expected_override or worker.tp_size * worker.pp_size)
        self._update_region_metrics()
        log.info("registered worker=%s regions=%d bytes=%d groups=%d layers=%d", worker, len(mapped), reg.nbytes, len(groups), sum(len(g.layers) for g in groups))
        return pb.RegisterResponse(registration_generation=reg.generation, registered_bytes=reg.nbytes, daemon_epoch=self.epoch,
                                   worker_token=reg.worker_token)

    def unregister(self, worker: WorkerId, token: bytes | None = None) -> None:
        key = self.registered(worker, token).worker
        self._end_registration((key.tp_rank, key.pp_rank), "worker unregistered")

    def _end_registration(self, k: RankKey, reason: str, *, unlink: bool = False) -> None:
        """The worker left: its pulls and publications end with ``reason``, its
        memory is unmapped, and with ``unlink`` (its creator is gone) removed."""
        self.puller.cancel_rank(k)
        self.publisher.abort_rank(k, reason)
        self._release(self.registrations.pop(k), unlink=unlink)
        self.finished[k].wake()  # its WatchFinished streams end
        self.registration_version += 1
        self._update_region_metrics()

    def _release(self, reg: Registration, *, unlink: bool = False) -> None:
        def unmap() -> None:
            reg.tensors.clear()  # views keep a mapping alive
            self._unmap(reg.regions, reg.nixl_handles)
            if unlink:
                for name in shm_names(reg):
                    shm.unlink_name(name)

        close_later(unmap)

    def _registered_shm(self) -> dict[RankKey, list[str]]:
        return {k: shm_names(reg) for k, reg in self.registrations.items()}

    def registered(self, worker: WorkerId, token: bytes | None = None) -> Registration:
        """The worker's registration; with ``token``, only for the worker itself."""
        if worker.engine_id != self.config.engine_id:
            raise InvalidArgument("worker.engine_id", worker.engine_id, f"does not match this daemon's engine {self.config.engine_id!r}")
        reg = self.registrations.get((worker.tp_rank, worker.pp_rank))
        if reg is None:
            raise NotFound(f"worker {worker} is not registered with this daemon")
        if token is not None and not hmac.compare_digest(token, reg.worker_token):
            raise PermissionDenied(f"only the registered worker {worker} may act for its engine and rank (kvd-worker-token missing or wrong)")
        return reg

    def check_engine_token(self, engine_id: str, token: bytes) -> None:
        """Engine-level calls need the token of some worker of this engine."""
        self.check_engine(engine_id)
        if not any(hmac.compare_digest(token, r.worker_token) for r in self.registrations.values()):
            raise PermissionDenied(f"engine-level calls for {engine_id!r} need a registered worker's kvd-worker-token")

    def _update_region_metrics(self) -> None:
        self.metrics.regions.set(sum(len(r.regions) for r in self.registrations.values()))
        self.metrics.region_bytes.set(sum(r.nbytes for r in self.registrations.values()))

    # ------------------------------------------------------------ engine metadata and handshake

    def engine_meta(self) -> EngineMeta:
        """This engine as peers see it; rebuilt only when a worker (un)registers."""
        cached = self._meta_cache
        if cached is not None and cached[0] == self.registration_version:
            return cached[1]
        regs = list(self.registrations.values())
        if not regs:
            raise Unavailable(f"engine {self.config.engine_id!r} has no registered workers yet")
        w = regs[0].worker
        meta = EngineMeta(
            engine_id=self.config.engine_id, epoch=self.epoch, host_id=self.host_id, data_address=self.data_address,
            tp_size=w.tp_size, pp_size=w.pp_size, model=regs[0].model,
            ranks=tuple(EngineLayout(r.worker.tp_rank, r.worker.pp_rank, tuple(r.groups)) for r in sorted(regs, key=lambda r: (r.worker.pp_rank, r.worker.tp_rank))),
            features=(LAYER_STREAM,), kvd_version=__version__, wire_version=WIRE_VERSION,
        )
        self._meta_cache = (self.registration_version, meta)
        return meta

    # ------------------------------------------------------------ abort, finished sets

    def abort(self, req: pb.AbortRequest, token: bytes | None = None) -> bool:
        """Either side: D cancels its pull (and tells P), P ends its publication."""
        worker = worker_from_pb(req.worker)
        self.registered(worker, token)
        check_request_id("request_id", req.request_id)
        rank = (worker.tp_rank, worker.pp_rank)
        pulled = self.puller.abort(req, rank)
        published = self.publisher.abort(req.request_id, rank)
        return pulled or published

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.auth.aio_channel(address)
        return ch

    def spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ finished sets

    def get_finished(self, worker: WorkerId, token: bytes | None = None) -> WorkerFinished:
        self.registered(worker, token)
        return self.finished[(worker.tp_rank, worker.pp_rank)].drain()

    def emit(self, rank: RankKey, outcome: Outcome, invalid: Sequence[int] = ()) -> None:
        """A worker's outcome: into its own box, and to the engine's aggregator."""
        self._last_outcome_at = time.monotonic()
        box = self.finished.setdefault(rank, WorkerFinished())
        box.add(outcome, invalid)
        if dropped := box.bound():  # almost never: skip the label lookup on every outcome
            self.metrics.unread_dropped.labels("worker").inc(dropped)
        if self.config.aggregator_address and self.config.aggregator_address != self.grpc_address:
            self.reports.queue(rank, outcome, invalid)
        else:
            one = WorkerFinished()
            one.add(outcome, invalid)
            self.report_to_hub(one)

    def report_to_hub(self, output: WorkerFinished) -> None:
        before = self.engine_hub.dropped
        self.engine_hub.report(output)
        if self.engine_hub.dropped > before:
            self.metrics.unread_dropped.labels("engine").inc(self.engine_hub.dropped - before)

    def engine_finished(self, engine_id: str) -> WorkerFinished:
        self.check_engine(engine_id)
        return self.engine_hub.drain()

    def set_expected_finished_count(self, engine_id: str, count: int) -> int:
        self.check_engine(engine_id)
        self._expected_override = count
        regs = list(self.registrations.values())
        world = regs[0].worker.tp_size * regs[0].worker.pp_size if regs else 1
        self.engine_hub.set_expected(count or world)
        return self.engine_hub.expected

    def check_engine(self, engine_id: str) -> None:
        if engine_id != self.config.engine_id:
            raise InvalidArgument("engine_id", engine_id, f"is not this daemon's engine {self.config.engine_id!r}")

    def check_peer_engine(self, engine_id: str) -> None:
        """A peer's call about a publication (abort, renew, resolve) names the
        engine it means: one that reached the wrong daemon changes nothing here."""
        if engine_id != self.config.engine_id:
            raise FailedPrecondition(f"engine_id={engine_id!r} names another engine: this daemon serves engine_id={self.config.engine_id!r}")

    def report_sending(self, ended: Ended) -> None:
        self.emit(ended.rank, Outcome(ended.request_id, "sending", ended.outcome, ended.reason))
        if ended.outcome == "expired":
            self.metrics.leases_expired.inc()

    def status(self) -> pb.StatusResponse:
        now = time.monotonic()
        return pb.StatusResponse(
            engine_id=self.config.engine_id, epoch=self.epoch, version=__version__, draining=self.draining,
            workers=[pb.WorkerStatus(worker=worker_to_pb(r.worker), regions=len(r.regions), bytes=r.nbytes, layers=sum(len(g.layers) for g in r.groups), region_ids=sorted(r.regions)) for r in self.registrations.values()],
            peers=sorted(self.handshakes.peers), publications=len(self.publications), pinned_ranks=self.publications.pinned, pulls_in_flight=len(self.puller.pulls),
            leases=[pb.LeaseStatus(request_id=p.request_id, generation=p.generation, ranks=[f"tp{t}/pp{q}" for t, q in sorted(p.masks)], expires_in_seconds=p.expires_at - now)
                    for p in list(self.publications.by_request.values())[:200]],
            pulls=[pb.PullStatus(request_id=rid, worker=str(p.worker), remote_engine_id=p.params.remote_engine_id, age_seconds=now - p.started,
                                 phase=p.progress.phase, landed_bytes=landed, planned_bytes=planned)
                   for (_, rid), p in list(self.puller.pulls.items())[:200] for landed, planned in [p.progress.landed_bytes()]],
            recent_failures=[pb.FailureStatus(request_id=f.request_id, reason=f.reason, message=f.message, age_seconds=now - f.at) for f in self.puller.recent_failures],
            staging_buffers=self.data_client.staging_buffers(), staging_bytes=self.data_client.staging_bytes(),
            tasks=len(self._tasks) + len(self.puller.pulls),
        )
