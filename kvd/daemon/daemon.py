"""The daemon: one engine's registrations, publications, pulls and peers.

``Daemon`` composes the pure core (leases, transfer planning, aggregation)
with the shells (gRPC service, data-plane transport). Every public method is
what one RPC or data-plane event asks for; none of them blocks the loop on I/O
except the pull task, which runs in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from kvd import errors
from kvd.aggregate import Outcome, WorkerFinished
from kvd.convert import engine_from_pb, engine_to_pb, group_from_pb, model_from_pb, worker_from_pb
from kvd.daemon.metrics import Metrics
from kvd.errors import (
    FailedPrecondition,
    Incompatible,
    InvalidArgument,
    KvdError,
    NotFound,
    Unavailable,
)
from kvd.leases import Ended, PublicationTable, RankKey
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
    copy_blocks,
    engine_shape,
    plan_pull,
    serve_segment,
    validate_segment,
)
from kvd.transport.base import Staging
from kvd.transport.tcp import TcpDataClient, TcpDataServer

log = logging.getLogger("kvd.daemon")


@dataclass
class DaemonConfig:
    engine_id: str
    host: str = "127.0.0.1"
    grpc_port: int = 0
    data_port: int = 0
    metrics_port: int = 0  # 0 = pick a free port; -1 = no metrics endpoint
    advertise_host: str = ""  # what peers dial; defaults to host
    lease_seconds: float = 120.0
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    connections_per_peer: int = 4
    pull_timeout_seconds: float = 60.0
    drain_seconds: float = 10.0
    handshake_retries: int = 3
    pull_retries: int = 2


@dataclass
class Registration:
    worker: WorkerId
    model: ModelInfo
    regions: dict[str, MappedRegion]
    groups: list[GroupSpec]
    tensors: list[GroupTensors]
    generation: int

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
    expected_readers: dict[RankKey, int] = field(default_factory=dict)


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
        self.epoch = uuid.uuid4().hex
        self.host_id = host_id()
        self.metrics = Metrics()
        self.registrations: dict[RankKey, Registration] = {}
        self.finished: dict[RankKey, WorkerFinished] = {}
        self.publications = PublicationTable(config.lease_seconds, self.epoch)
        self.peers: dict[str, Peer] = {}  # by engine id, peers we read from or that read from us
        self.pulls: dict[tuple[RankKey, str], asyncio.Task[None]] = {}
        self._registration_version = 0
        self._generation = 0
        self._draining = False
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._handshake_locks: dict[str, asyncio.Lock] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._replica_done: dict[tuple[str, int, RankKey], asyncio.Future[list[list[int]]]] = {}
        self.data_server = TcpDataServer(self, config.host, config.data_port)
        self.data_client = TcpDataClient(pb.DataHello(engine_id=config.engine_id, epoch=self.epoch), connections_per_peer=config.connections_per_peer, stall_timeout_s=config.pull_timeout_seconds)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.config.data_port = await self.data_server.start()
        self._sweeper = asyncio.create_task(self._sweep_leases())

    @property
    def data_address(self) -> str:
        return f"{self.config.advertise_host or self.config.host}:{self.config.data_port}"

    async def drain(self) -> None:
        """Stop new work; let in-flight pulls finish within the drain bound, then fail them."""
        self._draining = True
        tasks = list(self.pulls.values())
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.config.drain_seconds)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.data_server.close()
        await self.data_client.close()
        for ch in self._channels.values():
            await ch.close()
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
            # The worker restarted: its old memory is gone, so is anything published from it.
            for ended in self._abort_rank_publications(key, "worker re-registered"):
                self._report_sending(ended)
            old.close()
        self._generation += 1
        self._registration_version += 1
        reg = Registration(worker, model, mapped, groups, tensors, self._generation)
        self.registrations[key] = reg
        self.finished.setdefault(key, WorkerFinished())
        self._update_region_metrics()
        log.info("registered worker=%s regions=%d bytes=%d groups=%d layers=%d", worker, len(mapped), reg.nbytes, len(groups), sum(len(g.layers) for g in groups))
        return pb.RegisterResponse(registration_generation=reg.generation, registered_bytes=reg.nbytes, daemon_epoch=self.epoch)

    def unregister(self, worker: WorkerId) -> None:
        key = self._registered(worker).worker
        k = (key.tp_rank, key.pp_rank)
        for t in [t for (r, _), t in self.pulls.items() if r == k]:
            t.cancel()
        for ended in self._abort_rank_publications(k, "worker unregistered"):
            self._report_sending(ended)
        self.registrations.pop(k).close()
        self._registration_version += 1
        self._update_region_metrics()

    def _registered(self, worker: WorkerId) -> Registration:
        if worker.engine_id != self.config.engine_id:
            raise InvalidArgument("worker.engine_id", worker.engine_id, f"does not match this daemon's engine {self.config.engine_id!r}")
        reg = self.registrations.get((worker.tp_rank, worker.pp_rank))
        if reg is None:
            raise NotFound(f"worker {worker} is not registered with this daemon")
        return reg

    def _update_region_metrics(self) -> None:
        self.metrics.regions.set(sum(len(r.regions) for r in self.registrations.values()))
        self.metrics.region_bytes.set(sum(r.nbytes for r in self.registrations.values()))

    # ------------------------------------------------------------ engine metadata and handshake

    def engine_meta(self) -> EngineMeta:
        regs = list(self.registrations.values())
        if not regs:
            raise Unavailable(f"engine {self.config.engine_id!r} has no registered workers yet")
        w = regs[0].worker
        return EngineMeta(
            engine_id=self.config.engine_id, epoch=self.epoch, host_id=self.host_id, data_address=self.data_address,
            tp_size=w.tp_size, pp_size=w.pp_size, model=regs[0].model,
            ranks=tuple(EngineLayout(r.worker.tp_rank, r.worker.pp_rank, tuple(r.groups)) for r in sorted(regs, key=lambda r: (r.worker.pp_rank, r.worker.tp_rank))),
        )

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
        self.peers[theirs.engine_id] = Peer(theirs, "", self._registration_version)
        self.metrics.handshakes.labels("callee", "ok").inc()
        log.info("handshake from engine=%s epoch=%s tp=%d pp=%d", theirs.engine_id, theirs.epoch[:8], theirs.tp_size, theirs.pp_size)
        return pb.HandshakeResponse(callee=engine_to_pb(mine, self._fingerprint(mine)))

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
            channel = self._channels.get(params.remote_address)
            if channel is None:
                channel = self._channels[params.remote_address] = grpc.aio.insecure_channel(params.remote_address)
            stub = pbg.PeerStub(channel)
            t0 = time.perf_counter()
            last: Exception | None = None
            for attempt in range(self.config.handshake_retries):
                try:
                    resp = await stub.Handshake(pb.HandshakeRequest(caller=engine_to_pb(mine, self._fingerprint(mine))), timeout=10)
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
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
            self.peers[eid] = peer
            return peer

    # ------------------------------------------------------------ publish (P side)

    def publish(self, req: pb.PublishRequest) -> pb.PublishResponse:
        worker = worker_from_pb(req.worker)
        reg = self._registered(worker)
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
        return pb.PublishResponse(params=pb.TransferParams(
            remote_engine_id=self.config.engine_id, remote_address=self.grpc_address, remote_epoch=self.epoch,
            request_id=req.request_id, generation=pub.generation, capability=pub.capability,
            block_ids=[pb.BlockIds(ids=list(b.ids)) for b in req.block_ids], num_tokens=req.num_tokens,
            remote_tp_size=worker.tp_size, remote_pp_size=worker.pp_size,
        ))

    grpc_address = ""  # set by the server shell once it is bound

    # ------------------------------------------------------------ data plane, owner side

    def check_hello(self, hello: pb.DataHello) -> None:
        peer = self.peers.get(hello.engine_id)
        if peer is None or peer.meta.epoch != hello.epoch:
            self.metrics.refused_reads.labels("no_handshake").inc()
            raise FailedPrecondition(f"engine {hello.engine_id!r} epoch {hello.epoch[:8]} has not handshaken with this daemon")

    def open_read(self, hello: pb.DataHello, read: pb.DataRead) -> _OpenRead:
        try:
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
                self.publications.check_blocks(pub, rank, seg.group_id, seg.block_start, seg.block_count)
        except KvdError as e:
            self.metrics.refused_reads.labels(e.code.name.lower()).inc()
            raise
        return _OpenRead(self, reg, read, hello.engine_id)

    def _expected_readers(self, reader_engine: str, rank: RankKey) -> int:
        peer = self.peers.get(reader_engine)
        if peer is None:
            return 1
        if rank not in peer.expected_readers:
            mine = engine_shape(self.engine_meta())
            theirs = engine_shape(peer.meta)
            present = frozenset((r.tp_rank, r.pp_rank) for r in peer.meta.ranks)
            count = 0
            for pp in theirs.layers_by_pp_rank:
                for tp in range(theirs.tp_size):
                    targets = read_targets(theirs, mine, tp, pp, present)
                    count += any((t.remote_tp_rank, t.remote_pp_rank) == rank for t in targets)
            peer.expected_readers[rank] = count
        return peer.expected_readers[rank]

    def read_acknowledged(self, read: pb.DataRead, reader_engine: str) -> None:
        rank = (read.tp_rank, read.pp_rank)
        ended = self.publications.ack(
            read.request_id, read.generation, rank, (reader_engine, read.reader_tp_rank, read.reader_pp_rank),
            max(1, self._expected_readers(reader_engine, rank)),
        )
        pub = self.publications.by_request.get(read.request_id)
        if ended and pub is not None and pub.generation == read.generation:
            # Ranks nobody reads (replicated heads, MLA) are done once every
            # rank that is read has been.
            unread = [r for r in pub.masks if self._expected_readers(reader_engine, r) == 0]
            if len(unread) == len(pub.masks):
                for r in unread:
                    ended.extend(self.publications.ack(read.request_id, read.generation, r, (reader_engine, -1, -1), 1))
        for e in ended:
            self._report_sending(e)

    # ------------------------------------------------------------ pull (D side)

    def pull(self, req: pb.PullRequest) -> pb.PullResponse:
        worker = worker_from_pb(req.worker)
        reg = self._registered(worker)
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
        task = asyncio.create_task(self._run_pull(reg, req))
        self.pulls[key] = task
        task.add_done_callback(lambda _t: self.pulls.pop(key, None))
        return pb.PullResponse(accepted=True)

    async def _run_pull(self, reg: Registration, req: pb.PullRequest) -> None:
        rank = (reg.worker.tp_rank, reg.worker.pp_rank)
        local_ids = [list(b.ids) for b in req.local_block_ids]
        all_local = sorted({i for ids in local_ids for i in ids})
        t0 = time.perf_counter()
        self.metrics.pulls_in_flight.inc()
        sinks_all: list = []
        landed_all: list[list[bool]] = []
        try:
            for attempt in range(self.config.pull_retries + 1):
                sinks_all.clear()
                landed_all.clear()
                try:
                    moved = await self._attempt_pull(reg, req, rank, local_ids, sinks_all, landed_all)
                    break
                except (ConnectionError, OSError, Unavailable) as e:
                    # Transient: the peer may have restarted. Forget what we knew
                    # (handshake, pooled connections) and try again, boundedly.
                    stale = self.peers.pop(req.params.remote_engine_id, None)
                    if stale is not None:
                        await self.data_client.forget(stale.meta.data_address)
                    if attempt == self.config.pull_retries:
                        raise
                    log.info("retrying pull request_id=%s after %s: %s", req.request_id, type(e).__name__, e)
                    await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
            total = moved
            landed = self._replica_future(req.params, rank)
            if not landed.done():
                landed.set_result(local_ids)
            self.metrics.bytes_received.labels("tcp").inc(total)
            self.metrics.blocks_received.labels("tcp").inc(len(all_local))
            self.metrics.transfer_seconds.labels("done").observe(time.perf_counter() - t0)
            self.finished[rank].add(Outcome(req.request_id, "recving", "done", bytes=total))
        except BaseException as e:
            reason, message = _failure_reason(e)
            invalid = _unlanded_blocks(sinks_all, landed_all, all_local)
            fut = self._replica_done.get((req.params.request_id, req.params.generation, rank))
            if fut is not None and not fut.done():
                fut.set_exception(FailedPrecondition(message))
                fut.exception()  # nobody may be waiting; don't warn about it
            self.metrics.failures.labels(reason).inc()
            self.metrics.transfer_seconds.labels("failed").observe(time.perf_counter() - t0)
            self.finished[rank].add(Outcome(req.request_id, "recving", "failed", message), invalid)
            log.warning("pull failed request_id=%s worker=%s reason=%s invalid_blocks=%d: %s", req.request_id, reg.worker, reason, len(invalid), message)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self.metrics.pulls_in_flight.dec()

    async def _attempt_pull(self, reg: Registration, req: pb.PullRequest, rank: RankKey, local_ids: list[list[int]],
                            sinks_all: list, landed_all: list[list[bool]]) -> int:
        local_meta = self.engine_meta()
        present = frozenset((r.tp_rank, r.pp_rank) for r in local_meta.ranks)
        source = fanout_source(engine_shape(local_meta), rank[0], rank[1], present)
        if source is not None:
            return await self._copy_from_replica(reg, req, (source, rank[1]), local_ids)
        peer = await self._peer_for(req.params)
        if peer.meta.epoch != req.params.remote_epoch:
            raise FailedPrecondition(
                f"remote engine {req.params.remote_engine_id!r} restarted: params epoch {req.params.remote_epoch[:8]} != current {peer.meta.epoch[:8]}; its publication is gone"
            )
        reads = plan_pull(
            local_meta=self.engine_meta(), local_tp_rank=rank[0], local_pp_rank=rank[1],
            local_groups=reg.tensors, local_group_specs=reg.groups, remote=peer.meta, params=req.params,
            local_block_ids=local_ids, segment_bytes=self.config.segment_bytes,
        )
        for rr in reads:
            rr.read.reader_tp_rank, rr.read.reader_pp_rank = rank
            sinks_all.append(rr.sinks)
            landed_all.append([False] * len(rr.sinks))
        self._replica_future(req.params, rank)  # replicas may wait on us
        planned = sum(rr.nbytes for rr in reads)
        self.metrics.bytes_in_flight.inc(planned)
        try:
            moved = await asyncio.wait_for(
                asyncio.gather(*(self.data_client.read(peer.meta.data_address, rr.read, rr.sinks, landed) for rr, landed in zip(reads, landed_all, strict=True))),
                self.config.pull_timeout_seconds,
            )
        finally:
            self.metrics.bytes_in_flight.dec(planned)
        return sum(moved)

    def _replica_future(self, params: pb.TransferParams, rank: RankKey) -> asyncio.Future[list[list[int]]]:
        """Resolves with a rank's local block ids once its pull of ``params`` landed."""
        key = (params.request_id, params.generation, rank)
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
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, copy_blocks, src_reg.tensors, src_ids, reg.tensors, local_ids, req.params.num_tokens)

    # ------------------------------------------------------------ abort, finished sets

    def abort(self, req: pb.AbortRequest) -> bool:
        worker = worker_from_pb(req.worker)
        self._registered(worker)
        rank = (worker.tp_rank, worker.pp_rank)
        found = False
        task = self.pulls.get((rank, req.request_id))
        if task is not None:
            task.cancel()
            found = True
        for e in self.publications.abort(req.request_id, rank):
            self._report_sending(e)
            found = True
        return found

    def get_finished(self, worker: WorkerId) -> WorkerFinished:
        self._registered(worker)
        return self.finished[(worker.tp_rank, worker.pp_rank)].drain()

    def _report_sending(self, ended: Ended) -> None:
        box = self.finished.setdefault(ended.rank, WorkerFinished())
        box.add(Outcome(ended.request_id, "sending", ended.outcome, ended.reason))
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
        from kvd.convert import worker_to_pb

        return pb.StatusResponse(
            engine_id=self.config.engine_id, epoch=self.epoch, version=__version__,
            workers=[pb.WorkerStatus(worker=worker_to_pb(r.worker), regions=len(r.regions), bytes=r.nbytes, layers=sum(len(g.layers) for g in r.groups)) for r in self.registrations.values()],
            peers=sorted(self.peers), publications=len(self.publications), pulls_in_flight=len(self.pulls),
        )


class _OpenRead:
    def __init__(self, daemon: Daemon, reg: Registration, read: pb.DataRead, reader: str) -> None:
        self.daemon, self.reg, self.read, self.reader = daemon, reg, read, reader

    def segment(self, index: int, staging: Staging) -> torch.Tensor:
        seg = self.read.segments[index]
        payload = serve_segment(self.reg.tensors[seg.group_id], seg, self.read.head_start, self.read.head_count, staging)
        self.daemon.metrics.bytes_sent.labels("tcp").inc(payload.numel())
        self.daemon.metrics.blocks_sent.labels("tcp").inc(seg.block_count)
        return payload

    def acknowledged(self) -> None:
        self.daemon.read_acknowledged(self.read, self.reader)


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


def default_host() -> str:
    return os.environ.get("KVD_HOST", "127.0.0.1")
