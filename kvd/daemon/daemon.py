"""The daemon: one engine's registrations, publications, pulls and peers.

``Daemon`` composes the pure core (leases, transfer planning, aggregation)
with the shells (gRPC service, data-plane transport). Every public method is
what one RPC or data-plane event asks for; none of them blocks the loop on I/O
except the pull task, which runs in the background.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import logging
import secrets
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from kvd import errors
from kvd.aggregate import EngineFinishedHub, Outcome, WorkerFinished
from kvd.auth import AuthConfig
from kvd.convert import (
    engine_from_pb,
    engine_to_pb,
    group_from_pb,
    model_from_pb,
    worker_from_pb,
    worker_to_pb,
)
from kvd.daemon.metrics import ActiveClock, Metrics
from kvd.errors import (
    Aborted,
    FailedPrecondition,
    Incompatible,
    InvalidArgument,
    KvdError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvd.leases import Ended, PinKey, PublicationTable, RankKey
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from kvd.regions import MappedRegion, map_region
from kvd.relayout import GroupTensors
from kvd.spec import (
    EngineLayout,
    EngineMeta,
    GroupSpec,
    ModelInfo,
    WorkerId,
    compat_fields,
    fingerprint,
)
from kvd.topology import fanout_source, heads_of_rank, read_targets
from kvd.transfer import (
    DEFAULT_SEGMENT_BYTES,
    STRIPE_MIN_BYTES,
    GatherStaging,
    batched_pieces,
    copy_blocks,
    engine_shape,
    owner_iov,
    plan_pull,
    segment_nbytes,
    segment_view,
    serve_segment,
    stripe,
    validate_segment,
)
from kvd.transport.nixl import NixlAgent
from kvd.transport.nixl import available as nixl_available
from kvd.transport.tcp import LocalSource, TcpDataClient, TcpDataServer

log = logging.getLogger("kvd.daemon")


@dataclass
class DaemonConfig:
    engine_id: str
    host: str = "127.0.0.1"
    grpc_port: int = 0
    data_port: int = 0
    metrics_port: int = 0  # 0 = pick a free port; -1 = no metrics endpoint
    advertise_host: str = ""  # what peers dial; defaults to host
    data_advertise_address: str = ""  # host:port peers dial for the data plane (behind NAT or a proxy)
    lease_seconds: float = 120.0
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    connections_per_peer: int = 4
    pull_timeout_seconds: float = 60.0  # a whole pull, queueing excluded
    stall_timeout_seconds: float = 10.0  # no byte from a peer for this long fails the read
    max_concurrent_pulls: int = 64  # more are queued (and kept alive by heartbeat)
    drain_seconds: float = 10.0
    drain_report_seconds: float = 5.0  # after draining, how long workers get to collect outcomes
    handshake_retries: int = 3
    pull_retries: int = 2
    aggregator_address: str = ""  # the engine's aggregator daemon; empty: this one
    same_host: str = "auto"  # auto: copy directly between mapped regions when peers share a host; off: always TCP
    # Threads for a same-host copy: on 2 cores two process_vm_readv threads
    # beat one memcpy (6.4 vs 5 GB/s measured); more only help on more cores.
    copy_threads: int = 2
    # A read of one remote rank of at least stripe_min_bytes goes over this many
    # data connections at once (loopback: 2 streams moved ~4.1 vs ~3.5 GB/s).
    stripes_per_read: int = 2
    stripe_min_bytes: int = STRIPE_MIN_BYTES
    log_format: str = "text"  # text: key=value lines; json: one JSON object a line
    log_level: str = "INFO"
    # Security (docs/security.md)
    auth: str = "none"  # none | token | mtls
    token_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    worker_api: str = "local"  # local: Worker RPCs only from loopback or the Unix socket; any: from anywhere
    worker_socket: str = ""  # also serve the Worker API on this Unix socket path
    max_segments_per_read: int = 65536
    max_pending_handshakes: int = 64
    # Params made before P's worker published (vLLM's scheduler hands them out
    # first): how long P waits for the publication when D resolves them.
    publish_wait_seconds: float = 10.0
    max_pending_resolves: int = 1024
    # Data plane backend: tcp (kvd's own), or nixl (NIXL/UCX moves the bytes;
    # control, leases and relayout stay kvd's). nixl needs `pip install 'kvd[nixl]'`.
    transport: str = "tcp"
    nixl_staging_bytes: int = 1 << 30  # per connection: gather staging for one NIXL read


@dataclass
class Registration:
    worker: WorkerId
    model: ModelInfo
    regions: dict[str, MappedRegion]
    groups: list[GroupSpec]
    tensors: list[GroupTensors]
    generation: int
    region_pbs: list[pb.Region]
    worker_token: bytes = b""
    nixl_handles: list[object] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.regions.values())

    def close(self) -> None:
        self.tensors.clear()
        for r in self.regions.values():
            r.close()


@dataclass
class Peer:
    meta: EngineMeta
    address: str
    local_version: int  # our registration version when we handshook
    # Same host: the owner's ranks, mapped here, so reads are plain copies.
    local_sources: dict[RankKey, LocalSource] = field(default_factory=dict)
    mapped: list[MappedRegion] = field(default_factory=list)
    data_token: bytes = b""  # owner side: what this reader's HELLO must carry

    def close(self) -> None:
        self.local_sources.clear()
        for r in self.mapped:
            r.close()
        self.mapped.clear()


@dataclass
class ActivePull:
    """A pull queued or in flight, kept alive on P by heartbeat."""

    worker: WorkerId
    request: pb.PullRequest
    started: float
    task: asyncio.Task[None] | None = None
    next_renew: float = 0.0
    cancel_reason: str = ""  # why we cancelled it ourselves
    cancel_outcome: str = "failed"  # "aborted" when the local worker asked

    @property
    def params(self) -> pb.TransferParams:
        return self.request.params


@dataclass(frozen=True)
class Failure:
    request_id: str
    reason: str
    message: str
    at: float


def host_id() -> str:
    """Same value for every daemon on one host (and kernel boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        WorkerId(config.engine_id)  # validates the id
        self.config = config
        self.auth = AuthConfig.load(config.auth, config.token_file, config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
        self._handshake_slots = asyncio.Semaphore(config.max_pending_handshakes)
        self.epoch = uuid.uuid4().hex
        self.host_id = host_id()
        self.metrics = Metrics()
        self.active_clock = ActiveClock(self.metrics.active_seconds)
        self.registrations: dict[RankKey, Registration] = {}
        self.finished: dict[RankKey, WorkerFinished] = {}
        self.publications = PublicationTable(config.lease_seconds, self.epoch)
        self.peers: dict[str, Peer] = {}  # engines we read from, by engine id
        self.readers: dict[tuple[str, str], Peer] = {}  # daemons that read from us, by (engine id, epoch)
        self._expected: dict[tuple[str, RankKey], int] = {}
        self.pulls: dict[tuple[RankKey, str], ActivePull] = {}
        self.recent_failures: collections.deque[Failure] = collections.deque(maxlen=32)
        self.engine_hub = EngineFinishedHub()
        self._expected_override = 0
        self._pull_slots = asyncio.Semaphore(config.max_concurrent_pulls)
        self._to_aggregator: list[pb.ReportFinishedRequest] = []
        self._background: list[asyncio.Task[None]] = []
        self._registration_version = 0
        self._meta_cache: tuple[int, EngineMeta] | None = None
        self._generation = 0
        self._draining = False
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._handshake_locks: dict[str, asyncio.Lock] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._replica_done: dict[tuple[str, bytes, RankKey], asyncio.Future[list[list[int]]]] = {}
        self._published: dict[str, asyncio.Event] = {}  # request ids a Resolve waits for
        self._resolves = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.nixl = self._nixl_agent(config)
        self.data_server = TcpDataServer(self, config.host, config.data_port, tls=self.auth.data_plane_context(server=True),
                                         nixl=self.nixl, nixl_staging_bytes=config.nixl_staging_bytes)
        self.data_client = TcpDataClient(pb.DataHello(engine_id=config.engine_id, epoch=self.epoch, shared_token=self.auth.token),
                                         connections_per_peer=config.connections_per_peer, copy_threads=config.copy_threads,
                                         stall_timeout_s=config.stall_timeout_seconds, on_relayout=self.metrics.relayout_seconds.inc,
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
            return NixlAgent(f"kvd-{config.engine_id}-{self.epoch[:8]}")
        except (ImportError, OSError) as e:
            raise InvalidArgument("transport", "nixl", f"NIXL failed to load: {e}") from None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.config.data_port = await self.data_server.start()
        self._sweeper = asyncio.create_task(self._sweep_leases())
        self._background = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._forward_to_aggregator())]

    @property
    def data_address(self) -> str:
        if self.config.data_advertise_address:
            return self.config.data_advertise_address
        return f"{self.config.advertise_host or self.config.host}:{self.config.data_port}"

    async def drain(self) -> None:
        """Stop new work; let in-flight pulls finish within the drain bound, then fail them."""
        self._draining = True
        tasks = [p.task for p in self.pulls.values() if p.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.config.drain_seconds)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        # Report everything before exiting: give workers (and the aggregator)
        # a bounded time to collect what the drain produced.
        deadline = time.monotonic() + self.config.drain_report_seconds
        while time.monotonic() < deadline and (self._to_aggregator or any(b.sending or b.recving for b in self.finished.values())):
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for t in self._background:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.data_server.close()
        await self.data_client.close()
        if self.nixl is not None:
            self.nixl.close()
        for ch in self._channels.values():
            await ch.close()
        for peer in self.peers.values():
            peer.close()
        for reg in self.registrations.values():
            reg.close()
        self.registrations.clear()

    # ------------------------------------------------------------ registration

    def register(self, req: pb.RegisterRequest) -> pb.RegisterResponse:
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
        if not req.groups:
            raise InvalidArgument("groups", 0, "must register at least one KV cache group")
        groups = [group_from_pb(g, i) for i, g in enumerate(req.groups)]
        ids = [g.group_id for g in groups]
        if ids != list(range(len(groups))):
            raise InvalidArgument("groups.group_id", ids, "must be 0..n-1 in order")
        for g in groups:
            try:
                want = heads_of_rank(worker.tp_rank, worker.tp_size, model.total_num_kv_heads, g.spec.use_mla).count
            except Incompatible as e:
                raise InvalidArgument("worker.tp_size", worker.tp_size, f"cannot split model.total_num_kv_heads={model.total_num_kv_heads}: {e.message}") from None
            if g.spec.num_kv_heads != want:
                raise InvalidArgument(f"groups[{g.group_id}].spec.num_kv_heads", g.spec.num_kv_heads, f"should be {want} for tp_rank {worker.tp_rank} of {worker.tp_size} with {model.total_num_kv_heads} KV heads")
            bad = [i for i in g.layer_indices if i >= model.num_layers]
            if bad:
                raise InvalidArgument(f"groups[{g.group_id}].layers.layer_index", bad[0], f"is not below model.num_layers={model.num_layers}")
        mapped: dict[str, MappedRegion] = {}
        try:
            for region in req.regions:
                if region.region_id in mapped:
                    raise InvalidArgument("regions.region_id", region.region_id, "is listed twice")
                mapped[region.region_id] = map_region(region)
            tensors = [GroupTensors.build(g, {rid: r.tensor for rid, r in mapped.items()}) for g in groups]
        except BaseException:
            for r in mapped.values():
                r.close()
            raise
        key = (worker.tp_rank, worker.pp_rank)
        old = self.registrations.pop(key, None)
        if old is not None:
            # The worker restarted: its old memory is gone, so is anything published from it,
            # and its pulls (they would land in memory it no longer owns).
            for (rank_key, _), active in list(self.pulls.items()):
                if rank_key == key and active.task is not None:
                    active.task.cancel()
            for ended in self._abort_rank_publications(key, "worker re-registered"):
                self._report_sending(ended)
            self._release(old)
        self._generation += 1
        self._registration_version += 1
        reg = Registration(worker, model, mapped, groups, tensors, self._generation, list(req.regions), secrets.token_bytes(32))
        if self.nixl is not None:
            # NIXL reads and writes only registered memory: the worker's regions, as mapped here.
            reg.nixl_handles = [self.nixl.register(r.tensor.data_ptr(), r.size) for r in mapped.values() if r.tensor.device.type == "cpu"]
        self.registrations[key] = reg
        self.finished.setdefault(key, WorkerFinished())
        self.engine_hub.set_expected(self._expected_override or worker.tp_size * worker.pp_size)
        self._update_region_metrics()
        log.info("registered worker=%s regions=%d bytes=%d groups=%d layers=%d", worker, len(mapped), reg.nbytes, len(groups), sum(len(g.layers) for g in groups))
        return pb.RegisterResponse(registration_generation=reg.generation, registered_bytes=reg.nbytes, daemon_epoch=self.epoch,
                                   worker_token=reg.worker_token)

    def unregister(self, worker: WorkerId, token: bytes | None = None) -> None:
        key = self._registered(worker, token).worker
        k = (key.tp_rank, key.pp_rank)
        for p in [p for (r, _), p in self.pulls.items() if r == k]:
            if p.task is not None:
                p.task.cancel()
        for ended in self._abort_rank_publications(k, "worker unregistered"):
            self._report_sending(ended)
        self._release(self.registrations.pop(k))
        self._registration_version += 1
        self._update_region_metrics()

    def _release(self, reg: Registration) -> None:
        if self.nixl is not None:
            for h in reg.nixl_handles:
                self.nixl.deregister(h)
        reg.close()

    def _registered(self, worker: WorkerId, token: bytes | None = None) -> Registration:
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
        self._check_engine(engine_id)
        if not any(hmac.compare_digest(token, r.worker_token) for r in self.registrations.values()):
            raise PermissionDenied(f"engine-level calls for {engine_id!r} need a registered worker's kvd-worker-token")

    def _update_region_metrics(self) -> None:
        self.metrics.regions.set(sum(len(r.regions) for r in self.registrations.values()))
        self.metrics.region_bytes.set(sum(r.nbytes for r in self.registrations.values()))

    # ------------------------------------------------------------ engine metadata and handshake

    def engine_meta(self) -> EngineMeta:
        """This engine as peers see it; rebuilt only when a worker (un)registers."""
        cached = self._meta_cache
        if cached is not None and cached[0] == self._registration_version:
            return cached[1]
        regs = list(self.registrations.values())
        if not regs:
            raise Unavailable(f"engine {self.config.engine_id!r} has no registered workers yet")
        w = regs[0].worker
        meta = EngineMeta(
            engine_id=self.config.engine_id, epoch=self.epoch, host_id=self.host_id, data_address=self.data_address,
            tp_size=w.tp_size, pp_size=w.pp_size, model=regs[0].model,
            ranks=tuple(EngineLayout(r.worker.tp_rank, r.worker.pp_rank, tuple(r.groups)) for r in sorted(regs, key=lambda r: (r.worker.pp_rank, r.worker.tp_rank))),
        )
        self._meta_cache = (self._registration_version, meta)
        return meta

    def _fingerprint(self, meta: EngineMeta) -> str:
        return fingerprint(meta.model, meta.ranks[0].groups if meta.ranks else ())

    def check_compatible(self, mine: EngineMeta, theirs: EngineMeta) -> None:
        """Refuse a peer whose KV cannot mean the same thing, naming both values."""
        a = compat_fields(mine.model, mine.ranks[0].groups if mine.ranks else ())
        b = compat_fields(theirs.model, theirs.ranks[0].groups if theirs.ranks else ())
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                raise Incompatible(k, a.get(k), b.get(k), f"engines {mine.engine_id!r} and {theirs.engine_id!r} cannot exchange KV")
        from kvd.topology import check_pairing
        from kvd.transfer import check_group_pairing

        check_pairing(engine_shape(mine), engine_shape(theirs))
        # Every group must convert: block-size ratio, head size, layout kind.
        if mine.ranks and theirs.ranks:
            for g in mine.ranks[0].groups:
                other = next((x for x in theirs.ranks[0].groups if x.group_id == g.group_id), None)
                if other is None:
                    raise Incompatible(f"group[{g.group_id}]", "present", "absent")
                check_group_pairing(g, other)

    def handshake(self, req: pb.HandshakeRequest) -> pb.HandshakeResponse:
        """A peer introduces itself (it wants to read from us)."""
        theirs = engine_from_pb(req.caller)
        if not theirs.engine_id or theirs.engine_id == self.config.engine_id:
            raise InvalidArgument("caller.engine_id", theirs.engine_id, "must name another engine")
        mine = self.engine_meta()
        try:
            self.check_compatible(mine, theirs)
        except KvdError:
            self.metrics.handshakes.labels("callee", "refused").inc()
            raise
        # A restarted daemon of the same engine replaces its old epoch's entry.
        for key in [k for k, r in self.readers.items() if k[0] == theirs.engine_id and r.meta.host_id == theirs.host_id and r.meta.data_address == theirs.data_address]:
            del self.readers[key]
        data_token = secrets.token_bytes(32)
        self.readers[(theirs.engine_id, theirs.epoch)] = Peer(theirs, "", self._registration_version, data_token=data_token)
        self._expected = {k: v for k, v in self._expected.items() if k[0] != theirs.engine_id}
        self.metrics.handshakes.labels("callee", "ok").inc()
        same_host = self.config.same_host != "off" and theirs.host_id == self.host_id
        log.info("handshake from engine=%s epoch=%s tp=%d pp=%d same_host=%s", theirs.engine_id, theirs.epoch[:8], theirs.tp_size, theirs.pp_size, same_host)
        regions = {k: r.region_pbs for k, r in self.registrations.items()} if same_host else None
        return pb.HandshakeResponse(callee=engine_to_pb(mine, self._fingerprint(mine), regions), data_token=data_token)

    def _drop_peer(self, engine_id: str) -> Peer | None:
        """Forget a remote engine's handshake (and unmap its same-host regions)."""
        peer = self.peers.pop(engine_id, None)
        if peer is not None:
            peer.close()
        return peer

    async def _peer_for(self, params: pb.TransferParams) -> Peer:
        """The remote engine's metadata, handshaking once and again only after a
        restart on either side."""
        eid = params.remote_engine_id
        lock = self._handshake_locks.setdefault(eid, asyncio.Lock())
        async with lock:
            peer = self.peers.get(eid)
            if peer is not None and peer.address == params.remote_address and peer.meta.epoch == params.remote_epoch and peer.local_version == self._registration_version:
                return peer
            mine = self.engine_meta()
            stub = pbg.PeerStub(self._channel(params.remote_address))
            t0 = time.perf_counter()
            last: Exception | None = None
            for attempt in range(self.config.handshake_retries):
                try:
                    resp = await stub.Handshake(pb.HandshakeRequest(caller=engine_to_pb(mine, self._fingerprint(mine))), timeout=10,
                                                metadata=self.auth.call_metadata())
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
            theirs = engine_from_pb(resp.callee)
            if theirs.engine_id != eid:
                raise FailedPrecondition(f"{params.remote_address} serves engine {theirs.engine_id!r}, not remote_engine_id={eid!r}")
            self.check_compatible(mine, theirs)
            self.metrics.handshake_seconds.observe(time.perf_counter() - t0)
            self.metrics.handshakes.labels("caller", "ok").inc()
            peer = Peer(theirs, params.remote_address, self._registration_version)
            if self.config.same_host != "off" and theirs.host_id == self.host_id:
                self._map_same_host(peer, resp.callee)
            self._drop_peer(eid)
            self.data_client.set_token(theirs.data_address, resp.data_token)
            self.peers[eid] = peer
            return peer

    def _map_same_host(self, peer: Peer, callee: pb.EngineInfo) -> None:
        """Map the owner's regions; on any failure fall back to TCP."""
        try:
            for rank in callee.ranks:
                if not rank.regions:
                    continue
                mapped = {r.region_id: map_region(r) for r in rank.regions}
                peer.mapped.extend(mapped.values())
                views = {rid: m.tensor for rid, m in mapped.items()}
                groups = {g.group_id: GroupTensors.build(group_from_pb(g, i), views) for i, g in enumerate(rank.groups)}
                peer.local_sources[(rank.tp_rank, rank.pp_rank)] = LocalSource(groups)
            log.info("same-host path to engine=%s: %d ranks mapped", peer.meta.engine_id, len(peer.local_sources))
        except KvdError as e:
            log.warning("same-host path to engine=%s unavailable, using TCP: %s", peer.meta.engine_id, e.message)
            peer.close()

    # ------------------------------------------------------------ publish (P side)

    def publish(self, req: pb.PublishRequest, token: bytes | None = None) -> pb.PublishResponse:
        worker = worker_from_pb(req.worker)
        reg = self._registered(worker, token)
        if self._draining:
            raise Unavailable("daemon is draining")
        if req.num_tokens <= 0:
            raise InvalidArgument("num_tokens", req.num_tokens, "must be positive")
        num_blocks = [g.spec.num_blocks for g in reg.groups]
        pub = self.publications.publish(
            (worker.tp_rank, worker.pp_rank), req.request_id, [list(b.ids) for b in req.block_ids], num_blocks,
            req.num_tokens, time.monotonic(), capability=req.capability, reader_engine_id=req.reader_engine_id,
            lease_s=req.lease_seconds,
        )
        self.metrics.leases_held.set(len(self.publications))
        event = self._published.pop(req.request_id, None)
        if event is not None:
            event.set()
        return pb.PublishResponse(params=pb.TransferParams(
            remote_engine_id=self.config.engine_id, remote_address=self.grpc_address, remote_epoch=self.epoch,
            request_id=req.request_id, generation=pub.generation, capability=pub.capability,
            block_ids=[pb.BlockIds(ids=list(b.ids)) for b in req.block_ids], num_tokens=req.num_tokens,
            remote_tp_size=worker.tp_size, remote_pp_size=worker.pp_size,
            lease_seconds=req.lease_seconds if req.lease_seconds > 0 else self.config.lease_seconds,
        ))

    grpc_address = ""  # set by the server shell once it is bound

    async def resolve(self, req: pb.ResolveRequest) -> pb.ResolveResponse:
        """The generation of ``request_id`` published under ``capability``,
        once every rank registered here has published it (or the wait ends
        with at least one). Refused like a read if nothing matches."""
        if req.engine_id != self.config.engine_id:
            raise InvalidArgument("engine_id", req.engine_id, f"is not this daemon's engine {self.config.engine_id!r}")
        if self._resolves >= self.config.max_pending_resolves:
            raise ResourceExhausted(f"more than {self.config.max_pending_resolves} resolves pending")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(req.wait_seconds, self.config.publish_wait_seconds))
        self._resolves += 1
        try:
            while True:
                pub = self.publications.by_request.get(req.request_id)
                matches = pub is not None and hmac.compare_digest(pub.capability, req.capability)
                if matches and pub is not None and set(self.registrations) <= set(pub.masks):
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    if matches:
                        break  # some ranks published: reads of the others are refused one by one
                    raise PermissionDenied(f"no publication of request_id={req.request_id!r} matches this capability "
                                           f"(waited {min(req.wait_seconds, self.config.publish_wait_seconds):g}s)")
                event = self._published.setdefault(req.request_id, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            self._resolves -= 1
            if not self._resolves:
                self._published.clear()
        assert pub is not None
        return pb.ResolveResponse(generation=pub.generation, epoch=self.epoch, ranks_published=len(pub.masks))

    # ------------------------------------------------------------ data plane, owner side

    def check_hello(self, hello: pb.DataHello) -> None:
        """Before a single byte of KV: the shared token (auth=token), then the
        per-reader secret issued by this daemon's handshake."""
        reader = self.readers.get((hello.engine_id, hello.epoch))
        if reader is None:
            self.metrics.refused_reads.labels("no_handshake").inc()
            raise Unauthenticated(f"engine {hello.engine_id!r} epoch {hello.epoch[:8]} has not handshaken with this daemon")
        if not self.auth.check_hello_token(hello.shared_token) or not hmac.compare_digest(hello.data_token, reader.data_token):
            self.metrics.refused_reads.labels("unauthenticated").inc()
            raise Unauthenticated("data-plane HELLO without valid credentials")

    def open_read(self, hello: pb.DataHello, read: pb.DataRead, *, local: bool = False, reader_copies: bool = False) -> _OpenRead:
        """Authorise ``read``. ``reader_copies``: the reader will copy our
        memory itself (same host, NIXL), so the rank stays pinned until the
        returned read is closed."""
        try:
            if local:
                reader = self.readers.get((hello.engine_id, hello.epoch))
                if reader is None or reader.meta.host_id != self.host_id or self.config.same_host == "off":
                    raise PermissionDenied("a same-host read from a reader on another host (or with same_host=off)")
            if len(read.segments) > self.config.max_segments_per_read:
                raise InvalidArgument("read.segments", f"<{len(read.segments)} segments>", f"exceeds the limit of {self.config.max_segments_per_read}")
            if read.stripes > MAX_STRIPES or read.stripe >= max(1, read.stripes):
                raise InvalidArgument("read.stripe", f"{read.stripe} of {read.stripes}", f"must be below read.stripes, itself at most {MAX_STRIPES}")
            if read.owner_engine_id != self.config.engine_id:
                raise InvalidArgument("read.owner_engine_id", read.owner_engine_id, f"is not this daemon's engine {self.config.engine_id!r}")
            rank = (read.tp_rank, read.pp_rank)
            reg = self.registrations.get(rank)
            if reg is None:
                raise NotFound(f"rank tp{rank[0]}/pp{rank[1]} is not registered here")
            pub = self.publications.authorize(read.request_id, read.generation, read.capability, hello.engine_id, rank, time.monotonic())
            for seg in read.segments:
                if seg.group_id >= len(reg.tensors):
                    raise InvalidArgument("segment.group_id", seg.group_id, f"is not one of {len(reg.tensors)} groups")
                validate_segment(reg.tensors[seg.group_id], seg, read.head_start, read.head_count)
                if seg.block_ids:
                    self.publications.check_block_list(pub, rank, seg.group_id, np.asarray(seg.block_ids, dtype=np.int64))
                else:
                    self.publications.check_blocks(pub, rank, seg.group_id, seg.block_start, seg.block_count)
        except KvdError as e:
            self.metrics.refused_reads.labels(e.code.name.lower()).inc()
            raise
        if local:
            self.metrics.bytes_sent.labels("samehost").inc(sum(segment_nbytes(reg.tensors[s.group_id].spec, s, read.head_count) for s in read.segments))
        pin = None
        if local or reader_copies:
            pin = self.publications.pin(pub, rank)
            self.metrics.pinned_ranks.set(self.publications.pinned)
        return _OpenRead(self, reg, read, hello.engine_id, pin)

    def close_read(self, pin: PinKey) -> None:
        for e in self.publications.unpin(pin):
            self._report_sending(e)
        self.metrics.pinned_ranks.set(self.publications.pinned)

    def _expected_readers(self, reader_engine: str, rank: RankKey) -> int:
        """How many ranks of ``reader_engine`` will read our ``rank``.

        Counted over the reader engine's whole TP x PP shape; a rank copies from
        a replica instead (fan-out) only when both sit on one daemon we have
        handshaken with. Unknown ranks are assumed to read: over-counting only
        delays the release to lease expiry, under-counting would refuse a read.
        """
        key = (reader_engine, rank)
        if key not in self._expected:
            daemons = [r.meta for (eid, _), r in self.readers.items() if eid == reader_engine]
            if not daemons:
                return 1
            mine = engine_shape(self.engine_meta())
            merged = dataclasses.replace(daemons[0], ranks=tuple(r for m in daemons for r in m.ranks))
            theirs = engine_shape(merged)
            count = 0
            for pp in range(theirs.pp_size):
                for tp in range(theirs.tp_size):
                    if pp not in theirs.layers_by_pp_rank:
                        count += 1  # a stage we know nothing of: assume it reads
                        continue
                    home = next((m for m in daemons if m.rank(tp, pp) is not None), None)
                    present = frozenset((r.tp_rank, r.pp_rank) for r in home.ranks) if home else frozenset()
                    targets = read_targets(theirs, mine, tp, pp, present)
                    count += any((t.remote_tp_rank, t.remote_pp_rank) == rank for t in targets)
            self._expected[key] = count
        return self._expected[key]

    def read_acknowledged(self, read: pb.DataRead, reader_engine: str) -> None:
        rank = (read.tp_rank, read.pp_rank)
        # Each stripe of a striped read is ACKed on its own connection.
        ended = self.publications.ack(
            read.request_id, read.generation, rank, (reader_engine, read.reader_tp_rank, read.reader_pp_rank, read.stripe),
            max(1, self._expected_readers(reader_engine, rank)) * max(1, read.stripes),
        )
        pub = self.publications.by_request.get(read.request_id)
        if ended and pub is not None and pub.generation == read.generation:
            # Ranks nobody reads (replicated heads, MLA) are done once every
            # rank that is read has been.
            unread = [r for r in pub.masks if self._expected_readers(reader_engine, r) == 0]
            if len(unread) == len(pub.masks):
                for r in unread:
                    ended.extend(self.publications.ack(read.request_id, read.generation, r, (reader_engine, -1, -1, 0), 1))
        for e in ended:
            self._report_sending(e)

    # ------------------------------------------------------------ pull (D side)

    def pull(self, req: pb.PullRequest, token: bytes | None = None) -> pb.PullResponse:
        worker = worker_from_pb(req.worker)
        reg = self._registered(worker, token)
        if self._draining:
            raise Unavailable("daemon is draining")
        p = req.params
        if not p.remote_engine_id:
            raise InvalidArgument("params.remote_engine_id", p.remote_engine_id, "must be set")
        if p.remote_engine_id == self.config.engine_id:
            raise InvalidArgument("params.remote_engine_id", p.remote_engine_id, "is this daemon's own engine")
        if not p.remote_address or ":" not in p.remote_address:
            raise InvalidArgument("params.remote_address", p.remote_address, "must be host:port")
        if p.num_tokens <= 0:
            raise InvalidArgument("params.num_tokens", p.num_tokens, "must be positive")
        if len(req.local_block_ids) != len(reg.groups):
            raise InvalidArgument("local_block_ids", f"<{len(req.local_block_ids)} groups>", f"must give one list per KV cache group ({len(reg.groups)})")
        for g, ids in zip(reg.groups, req.local_block_ids, strict=True):
            bad = [i for i in ids.ids if i >= g.spec.num_blocks]
            if bad:
                raise InvalidArgument(f"local_block_ids[{g.group_id}]", bad[0], f"is outside the registered range [0, {g.spec.num_blocks})")
        rank = (worker.tp_rank, worker.pp_rank)
        key = (rank, req.request_id)
        if key in self.pulls:
            raise FailedPrecondition(f"request_id={req.request_id!r} is already being pulled by {worker}")
        now = time.monotonic()
        active = ActivePull(worker, req, now, next_renew=now + _renew_interval(p))
        active.task = asyncio.create_task(self._run_pull(reg, active))
        self.pulls[key] = active
        active.task.add_done_callback(lambda _t: self.pulls.pop(key, None))
        return pb.PullResponse(accepted=True)

    async def _run_pull(self, reg: Registration, active: ActivePull) -> None:
        req = active.request
        rank = (reg.worker.tp_rank, reg.worker.pp_rank)
        local_ids = [list(b.ids) for b in req.local_block_ids]
        all_local = sorted({i for ids in local_ids for i in ids})
        t0 = time.perf_counter()
        self.metrics.pulls_in_flight.inc()
        sinks_all: list = []
        landed_all: list[list[bool]] = []
        try:
            async with self._pull_slots:
                t0 = time.perf_counter()
                moved = await asyncio.wait_for(self._pull_with_retries(reg, req, rank, local_ids, sinks_all, landed_all), self.config.pull_timeout_seconds)
            total = moved
            landed = self._replica_future(req.params, rank)
            if not landed.done():
                landed.set_result(local_ids)
            self.metrics.transfer_seconds.labels("done").observe(time.perf_counter() - t0)
            self._emit(rank, Outcome(req.request_id, "recving", "done", bytes=total))
        except BaseException as e:
            reason, message = _failure_reason(e)
            outcome = "failed"
            if isinstance(e, asyncio.CancelledError) and active.cancel_reason:
                outcome, message = active.cancel_outcome, active.cancel_reason
                reason = "aborted" if outcome == "aborted" else "lease_lost"
            invalid = _unlanded_blocks(sinks_all, landed_all, all_local)
            # Replicas copying from us fail now, even those that ask later.
            fut = self._replica_future(req.params, rank)
            if not fut.done():
                fut.set_exception(FailedPrecondition(message))
                fut.exception()  # nobody may be waiting; don't warn about it
            self.metrics.failures.labels(reason).inc()
            self.metrics.transfer_seconds.labels("failed").observe(time.perf_counter() - t0)
            self.recent_failures.append(Failure(req.request_id, reason, message, time.monotonic()))
            self._emit(rank, Outcome(req.request_id, "recving", outcome, message), invalid)
            log.warning("pull failed request_id=%s worker=%s reason=%s invalid_blocks=%d: %s", req.request_id, reg.worker, reason, len(invalid), message)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self.metrics.pulls_in_flight.dec()

    async def _pull_with_retries(self, reg: Registration, req: pb.PullRequest, rank: RankKey, local_ids: list[list[int]],
                                 sinks_all: list, landed_all: list[list[bool]]) -> int:
        # Reads that landed and were ACKed, with their bytes. A retry skips
        # them: P ended those ranks' publications on the ACK.
        landed_reads: dict[ReadKey, int] = {}
        for attempt in range(self.config.pull_retries + 1):
            sinks_all.clear()
            landed_all.clear()
            try:
                return await self._attempt_pull(reg, req, rank, local_ids, sinks_all, landed_all, landed_reads)
            except (ConnectionError, OSError, Unavailable) as e:
                # Transient: the peer may have restarted. Forget what we knew
                # (handshake, pooled connections) and try again, boundedly.
                stale = self._drop_peer(req.params.remote_engine_id)
                if stale is not None:
                    await self.data_client.forget(stale.meta.data_address)
                if attempt == self.config.pull_retries:
                    raise
                log.info("retrying pull request_id=%s after %s: %s", req.request_id, type(e).__name__, e)
                await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
        raise AssertionError("unreachable")

    async def _attempt_pull(self, reg: Registration, req: pb.PullRequest, rank: RankKey, local_ids: list[list[int]],
                            sinks_all: list, landed_all: list[list[bool]], landed_reads: dict[ReadKey, int]) -> int:
        local_meta = self.engine_meta()
        present = frozenset((r.tp_rank, r.pp_rank) for r in local_meta.ranks)
        source = fanout_source(engine_shape(local_meta), rank[0], rank[1], present)
        if source is not None:
            return await self._copy_from_replica(reg, req, (source, rank[1]), local_ids)
        if not req.params.generation:
            await self._resolve(req.params)  # before the handshake: it fills in the epoch the handshake is cached by
        peer = await self._peer_for(req.params)
        if peer.meta.epoch != req.params.remote_epoch:
            raise FailedPrecondition(
                f"remote engine {req.params.remote_engine_id!r} restarted: params epoch {req.params.remote_epoch[:8]} != current {peer.meta.epoch[:8]}; its publication is gone"
            )
        for fresh in (False, True):
            try:
                reads = plan_pull(
                    local_meta=local_meta, local_tp_rank=rank[0], local_pp_rank=rank[1],
                    local_groups=reg.tensors, local_group_specs=reg.groups, remote=peer.meta, params=req.params,
                    local_block_ids=local_ids, segment_bytes=self.config.segment_bytes,
                )
                break
            except Incompatible as e:
                if fresh or "not registered" not in e.message:
                    raise
                # Our view of the remote engine predates a rank it registered since: look again.
                self._drop_peer(req.params.remote_engine_id)
                peer = await self._peer_for(req.params)
        for rr in reads:
            rr.read.reader_tp_rank, rr.read.reader_pp_rank = rank
        if self.config.transport == "tcp" and self.config.stripes_per_read > 1:
            # A big read from another host goes over several connections at once.
            reads = [part for rr in reads
                     for part in (stripe(rr, self.config.stripes_per_read)
                                  if rr.nbytes >= self.config.stripe_min_bytes and (rr.read.tp_rank, rr.read.pp_rank) not in peer.local_sources else [rr])]
        keys = [_read_key(rr.read) for rr in reads]
        for rr, key in zip(reads, keys, strict=True):
            sinks_all.append(rr.sinks)
            landed_all.append([key in landed_reads] * len(rr.sinks))
        todo = [i for i, key in enumerate(keys) if key not in landed_reads]
        self._replica_future(req.params, rank)  # replicas may wait on us
        planned = sum(reads[i].nbytes for i in todo)
        self.metrics.bytes_in_flight.inc(planned)
        sources = [peer.local_sources.get((rr.read.tp_rank, rr.read.pp_rank)) for rr in reads]
        blocks: dict[str, list[np.ndarray]] = {}
        self.active_clock.start()
        try:
            tasks = {i: asyncio.ensure_future(self.data_client.read(peer.meta.data_address, reads[i].read, reads[i].sinks, landed_all[i], sources[i]))
                     for i in todo}
            try:
                await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
            finally:
                # One read failed (or we were cancelled): stop the others and wait
                # until they have, so nothing lands after the failure is reported.
                for t in tasks.values():
                    t.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)
                for i in tasks:
                    # Every segment landed: done, even if the task was then
                    # cancelled after its ACK (P ended that rank on it; were
                    # the ACK lost, P's lease ends the rank instead).
                    if not all(landed_all[i]):
                        continue
                    landed_reads[keys[i]] = n = reads[i].nbytes
                    transport = "samehost" if sources[i] is not None else self.config.transport
                    self.metrics.data_reads.labels(transport).inc()
                    self.metrics.bytes_received.labels(transport).inc(n)
                    blocks.setdefault(transport, []).extend(np.asarray(s.local_block_ids) for s in reads[i].sinks)
                for transport, ids in blocks.items():  # a block filled by several reads (ranks, stripes) counts once
                    self.metrics.blocks_received.labels(transport).inc(len(np.unique(np.concatenate(ids))))
            # Report the read that failed, not a sibling we cancelled because of it.
            failed = [t.exception() for t in tasks.values() if not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0]  # type: ignore[misc]
        finally:
            self.active_clock.stop()
            self.metrics.bytes_in_flight.dec(planned)
        return sum(landed_reads[key] for key in keys)

    async def _resolve(self, params: pb.TransferParams) -> None:
        """Fill in the generation (and epoch) of params made before P published."""
        wait = self.config.publish_wait_seconds
        try:
            resp = await pbg.PeerStub(self._channel(params.remote_address)).Resolve(
                pb.ResolveRequest(engine_id=params.remote_engine_id, request_id=params.request_id, capability=params.capability, wait_seconds=wait),
                timeout=wait + 10, metadata=self.auth.call_metadata())
        except grpc.aio.AioRpcError as e:
            raise errors.from_code(e.code().name, f"resolving request_id={params.request_id!r} on {params.remote_address}: {e.details()}") from None
        params.generation = resp.generation
        if not params.remote_epoch:
            params.remote_epoch = resp.epoch

    def _replica_future(self, params: pb.TransferParams, rank: RankKey) -> asyncio.Future[list[list[int]]]:
        """Resolves with a rank's local block ids once its pull of ``params`` landed.

        Keyed by the capability, which names one publication, so it holds
        before the generation is resolved too."""
        key = (params.request_id, params.capability, rank)
        fut = self._replica_done.get(key)
        if fut is None:
            fut = self._replica_done[key] = asyncio.get_running_loop().create_future()
            # Forget it once no replica can still need it.
            asyncio.get_running_loop().call_later(self.config.pull_timeout_seconds * 2, self._replica_done.pop, key, None)
        return fut

    async def _copy_from_replica(self, reg: Registration, req: pb.PullRequest, source: RankKey, local_ids: list[list[int]]) -> int:
        """Copy a request's blocks from the replica that read them, instead of
        reading the same remote bytes again."""
        fut = self._replica_future(req.params, source)
        try:
            src_ids = await asyncio.wait_for(asyncio.shield(fut), self.config.pull_timeout_seconds)
        except KvdError as e:
            raise FailedPrecondition(f"replica tp{source[0]}/pp{source[1]} failed to pull request_id={req.request_id!r}: {e.message}") from None
        src_reg = self.registrations.get(source)
        if src_reg is None:
            raise FailedPrecondition(f"replica tp{source[0]}/pp{source[1]} is no longer registered")
        work = asyncio.get_running_loop().run_in_executor(None, copy_blocks, src_reg.tensors, src_ids, reg.tensors, local_ids, req.params.num_tokens)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await work  # the copy is short; let it end before the failure is reported
            raise

    # ------------------------------------------------------------ abort, finished sets

    def abort(self, req: pb.AbortRequest, token: bytes | None = None) -> bool:
        """Either side: D cancels its pull (and tells P), P ends its publication."""
        worker = worker_from_pb(req.worker)
        self._registered(worker, token)
        rank = (worker.tp_rank, worker.pp_rank)
        found = False
        active = self.pulls.get((rank, req.request_id))
        if active is not None and active.task is not None:
            active.cancel_reason, active.cancel_outcome = f"aborted by {worker}", "aborted"
            active.task.cancel()
            self._spawn(self._abort_remote(active.params, f"reader {self.config.engine_id} aborted"))
            found = True
        for e in self.publications.abort(req.request_id, rank):
            self._report_sending(e)
            found = True
        if req.HasField("release") and req.release.remote_address:
            self._spawn(self._abort_remote(req.release, f"reader {self.config.engine_id} does not need it"))
            found = True
        return found

    async def _abort_remote(self, params: pb.TransferParams, reason: str) -> None:
        """Best effort: let P release the lease now rather than at expiry."""
        try:
            await pbg.PeerStub(self._channel(params.remote_address)).Abort(
                pb.PeerAbortRequest(engine_id=params.remote_engine_id, request_id=params.request_id, generation=params.generation,
                                    capability=params.capability, reason=reason), timeout=5, metadata=self.auth.call_metadata())
        except grpc.aio.AioRpcError as e:
            log.info("peer abort of request_id=%s not delivered: %s", params.request_id, e.code().name)

    def peer_abort(self, req: pb.PeerAbortRequest) -> bool:
        pub = self.publications.by_request.get(req.request_id)
        # Generation 0: a reader that had not resolved it yet; the capability names the publication.
        if pub is None or req.generation not in (0, pub.generation) or not hmac.compare_digest(pub.capability, req.capability):
            return False
        for e in self.publications.abort(req.request_id, None, req.reason or "aborted by the reader"):
            self._report_sending(e)
        return True

    def renew_leases(self, req: pb.RenewLeasesRequest) -> pb.RenewLeasesResponse:
        now = time.monotonic()
        alive = []
        for lease in req.leases:
            pub = self.publications.by_request.get(lease.request_id)
            ok = (pub is not None and hmac.compare_digest(pub.capability, lease.capability)
                  and self.publications.renew(lease.request_id, lease.generation, now))
            alive.append(bool(ok))
        return pb.RenewLeasesResponse(alive=alive)

    async def _heartbeat(self) -> None:
        """Renew P's leases for every pull queued or in flight, batched per peer."""
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            due: dict[str, list[ActivePull]] = {}
            for p in self.pulls.values():
                # Unresolved params have no lease yet (P is still to publish).
                if now >= p.next_renew and p.params.generation:
                    p.next_renew = now + _renew_interval(p.params)
                    due.setdefault(p.params.remote_address, []).append(p)
            for address, pulls in due.items():
                self._spawn(self._renew(address, pulls))

    async def _renew(self, address: str, pulls: list[ActivePull]) -> None:
        req = pb.RenewLeasesRequest(engine_id=pulls[0].params.remote_engine_id, reader_engine_id=self.config.engine_id,
                                    leases=[pb.LeaseRef(request_id=p.params.request_id, generation=p.params.generation, capability=p.params.capability) for p in pulls])
        try:
            resp = await pbg.PeerStub(self._channel(address)).RenewLeases(req, timeout=5, metadata=self.auth.call_metadata())
        except grpc.aio.AioRpcError as e:
            log.info("lease heartbeat to %s failed: %s", address, e.code().name)
            return  # the pull itself will find out
        for p, ok in zip(pulls, resp.alive, strict=False):
            if not ok and p.task is not None and not p.task.done():
                # Don't wait for a read that can only be refused.
                p.cancel_reason = f"publication of request_id={p.params.request_id!r} expired or ended on the prefill side"
                p.task.cancel()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.auth.aio_channel(address)
        return ch

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ finished sets

    def get_finished(self, worker: WorkerId, token: bytes | None = None) -> WorkerFinished:
        self._registered(worker, token)
        return self.finished[(worker.tp_rank, worker.pp_rank)].drain()

    def _emit(self, rank: RankKey, outcome: Outcome, invalid: Sequence[int] = ()) -> None:
        """A worker's outcome: into its own box, and to the engine's aggregator."""
        self.finished.setdefault(rank, WorkerFinished()).add(outcome, invalid)
        one = WorkerFinished()
        one.add(outcome, invalid)
        if self.config.aggregator_address and self.config.aggregator_address != self.grpc_address:
            reg = self.registrations.get(rank)
            wid = worker_to_pb(reg.worker) if reg is not None else pb.WorkerId(engine_id=self.config.engine_id, tp_rank=rank[0], pp_rank=rank[1])
            self._to_aggregator.append(pb.ReportFinishedRequest(
                engine_id=self.config.engine_id, worker=wid, invalid_block_ids=sorted(invalid),
                details=[pb.FinishedDetail(request_id=outcome.request_id, direction=outcome.direction, outcome=outcome.outcome, reason=outcome.reason, bytes=outcome.bytes)],
            ))
        else:
            self.engine_hub.report(one)

    def report_finished(self, req: pb.ReportFinishedRequest) -> None:
        """Another rank's daemon reports to us, the engine's aggregator."""
        if req.engine_id != self.config.engine_id:
            raise InvalidArgument("engine_id", req.engine_id, f"is not this aggregator's engine {self.config.engine_id!r}")
        out = WorkerFinished()
        for i, d in enumerate(req.details):
            out.add(Outcome(d.request_id, d.direction, d.outcome, d.reason, d.bytes), req.invalid_block_ids if i == 0 else ())
        self.engine_hub.report(out)

    async def _forward_to_aggregator(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            while self._to_aggregator:
                item = self._to_aggregator[0]
                try:
                    await pbg.PeerStub(self._channel(self.config.aggregator_address)).ReportFinished(item, timeout=5, metadata=self.auth.call_metadata())
                    self._to_aggregator.pop(0)
                except grpc.aio.AioRpcError as e:
                    log.warning("aggregator %s unreachable (%s); %d reports queued", self.config.aggregator_address, e.code().name, len(self._to_aggregator))
                    await asyncio.sleep(0.5)
                    break

    def engine_finished(self, engine_id: str) -> WorkerFinished:
        self._check_engine(engine_id)
        return self.engine_hub.drain()

    def set_expected_finished_count(self, engine_id: str, count: int) -> int:
        self._check_engine(engine_id)
        self._expected_override = count
        regs = list(self.registrations.values())
        world = regs[0].worker.tp_size * regs[0].worker.pp_size if regs else 1
        self.engine_hub.set_expected(count or world)
        return self.engine_hub.expected

    def _check_engine(self, engine_id: str) -> None:
        if engine_id != self.config.engine_id:
            raise InvalidArgument("engine_id", engine_id, f"is not this daemon's engine {self.config.engine_id!r}")

    def _report_sending(self, ended: Ended) -> None:
        self._emit(ended.rank, Outcome(ended.request_id, "sending", ended.outcome, ended.reason))
        if ended.outcome == "expired":
            self.metrics.leases_expired.inc()
        self.metrics.leases_held.set(len(self.publications))

    def _abort_rank_publications(self, rank: RankKey, reason: str) -> list[Ended]:
        out: list[Ended] = []
        for rid in [rid for rid, p in self.publications.by_request.items() if rank in p.masks]:
            out.extend(self.publications.abort(rid, rank, reason))
        return out

    async def _sweep_leases(self) -> None:
        while True:
            for e in self.publications.expire(time.monotonic()):
                log.info("lease expired request_id=%s rank=%s", e.request_id, e.rank)
                self._report_sending(e)
            await asyncio.sleep(0.5)

    def status(self) -> pb.StatusResponse:
        from kvd import __version__

        now = time.monotonic()
        return pb.StatusResponse(
            engine_id=self.config.engine_id, epoch=self.epoch, version=__version__, draining=self._draining,
            workers=[pb.WorkerStatus(worker=worker_to_pb(r.worker), regions=len(r.regions), bytes=r.nbytes, layers=sum(len(g.layers) for g in r.groups), region_ids=sorted(r.regions)) for r in self.registrations.values()],
            peers=sorted(self.peers), publications=len(self.publications), pinned_ranks=self.publications.pinned, pulls_in_flight=len(self.pulls),
            leases=[pb.LeaseStatus(request_id=p.request_id, generation=p.generation, ranks=[f"tp{t}/pp{q}" for t, q in sorted(p.masks)], expires_in_seconds=p.expires_at - now)
                    for p in list(self.publications.by_request.values())[:200]],
            pulls=[pb.PullStatus(request_id=rid, worker=str(p.worker), remote_engine_id=p.params.remote_engine_id, age_seconds=now - p.started)
                   for (_, rid), p in list(self.pulls.items())[:200]],
            recent_failures=[pb.FailureStatus(request_id=f.request_id, reason=f.reason, message=f.message, age_seconds=now - f.at) for f in self.recent_failures],
            staging_buffers=self.data_client.staging_buffers(), staging_bytes=self.data_client.staging_bytes(),
            tasks=len(self._tasks) + len(self.pulls),
        )


MAX_STRIPES = 64  # a reader claiming more would only hold the publication to its lease


class _OpenRead:
    def __init__(self, daemon: Daemon, reg: Registration, read: pb.DataRead, reader: str, pin: PinKey | None) -> None:
        self.daemon, self.reg, self.read, self.reader = daemon, reg, read, reader
        self.pin = pin  # the reader copies our memory itself: the rank is pinned until close()

    def segment(self, index: int, staging: GatherStaging, transport: str = "tcp") -> torch.Tensor:
        seg = self.read.segments[index]
        payload = serve_segment(self.reg.tensors[seg.group_id], seg, self.read.head_start, self.read.head_count, staging)
        self.daemon.metrics.bytes_sent.labels(transport).inc(payload.numel())
        self.daemon.metrics.blocks_sent.labels(transport).inc(seg.block_count)
        return payload

    def count_sent(self, nbytes: int, blocks: int, transport: str) -> None:
        """Metrics for segments that left without ``segment`` (exposed in place)."""
        self.daemon.metrics.bytes_sent.labels(transport).inc(nbytes)
        self.daemon.metrics.blocks_sent.labels(transport).inc(blocks)

    def segment_blocks(self, index: int) -> int:
        return self.read.segments[index].block_count

    def segment_device(self, index: int) -> torch.device:
        return self.reg.tensors[self.read.segments[index].group_id].device

    def segment_nbytes(self, index: int) -> int:
        seg = self.read.segments[index]
        return segment_nbytes(self.reg.tensors[seg.group_id].spec, seg, self.read.head_count)

    def segment_pieces(self, index: int) -> tuple[np.ndarray, int] | None:
        """A batched segment's bytes as equal pieces of registered memory, in wire order."""
        seg = self.read.segments[index]
        return batched_pieces(self.reg.tensors[seg.group_id], seg, self.read.head_start, self.read.head_count)

    def segment_iov(self, index: int) -> np.ndarray | None:
        """The segment's registered host memory as an iovec array, in wire order."""
        seg = self.read.segments[index]
        return owner_iov(self.reg.tensors[seg.group_id], seg, self.read.head_start, self.read.head_count)

    def segment_view(self, index: int) -> torch.Tensor | None:
        """The segment as a zero-copy view of registered memory, or None when it must be gathered."""
        seg = self.read.segments[index]
        return segment_view(self.reg.tensors[seg.group_id], seg, self.read.head_start, self.read.head_count)

    def acknowledged(self) -> None:
        self.close()
        self.daemon.read_acknowledged(self.read, self.reader)

    def close(self) -> None:
        """The read is over, one way or another (on the event loop)."""
        pin, self.pin = self.pin, None
        if pin is not None:
            self.daemon.close_read(pin)

    def check_alive(self) -> None:
        """Raise if the publication ended (aborted, expired) while being served."""
        pub = self.daemon.publications.by_request.get(self.read.request_id)
        rank = (self.read.tp_rank, self.read.pp_rank)
        if pub is None or pub.generation != self.read.generation or rank not in pub.masks:
            raise Aborted(f"publication of request_id={self.read.request_id!r} ended while being read")
        if time.monotonic() >= pub.expires_at:
            raise Aborted(f"publication of request_id={self.read.request_id!r} expired while being read")


def _renew_interval(params: pb.TransferParams) -> float:
    """Heartbeat three times per lease, so one lost beat does not lose the lease."""
    lease = params.lease_seconds if params.lease_seconds > 0 else 120.0
    return max(0.05, lease / 3)


def _failure_reason(e: BaseException) -> tuple[str, str]:
    if isinstance(e, asyncio.CancelledError):
        return "aborted", "pull aborted"
    if isinstance(e, asyncio.TimeoutError):
        return "timeout", "pull timed out"
    if isinstance(e, KvdError):
        return e.code.name.lower(), e.message
    if isinstance(e, (ConnectionError, OSError)):
        return "connection", f"{type(e).__name__}: {e}"
    return "internal", f"{type(e).__name__}: {e}"


# One read of a pull, the same in every attempt: (remote rank, head slice, stripe).
ReadKey = tuple[int, int, int, int, int]


def _read_key(read: pb.DataRead) -> ReadKey:
    return (read.tp_rank, read.pp_rank, read.head_start, read.stripe, read.stripes)


def _unlanded_blocks(sinks: Sequence[Sequence[object]], landed: Sequence[Sequence[bool]], all_local: list[int]) -> list[int]:
    """Exactly the local blocks some unlanded segment would have written."""
    if not sinks:
        return all_local
    bad: set[int] = set()
    for rank_sinks, rank_landed in zip(sinks, landed, strict=True):
        for sink, ok in zip(rank_sinks, rank_landed, strict=True):
            if not ok:
                bad.update(int(b) for b in np.asarray(sink.local_block_ids))  # type: ignore[attr-defined]
    return sorted(bad)
