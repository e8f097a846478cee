"""The prefill side of the daemon shell: publications and the reads of them.

``Publisher`` feeds the pure ``Owner`` (authorisation, expected readers,
acknowledgements, pins) and ``PublicationTable`` (leases) with what gRPC
and the data plane bring, adds the clock, and reports what ended. The data
plane sees an authorised read as an ``OpenRead``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvd.auth import AuthConfig
from kvd.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvdError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvd.core.leases import Ended, PublicationTable, check_lease_seconds
from kvd.core.owner import Grant, Owner
from kvd.core.pieces import (
    GatherStaging,
    batched_pieces,
    owner_iov,
    segment_nbytes,
    segment_view,
    serve_segment,
)
from kvd.core.reads import DataRead
from kvd.core.requests import Blocks, LeaseRef, PeerAbort, PublishOrder, Resolution, TransferParams
from kvd.core.session import Hello
from kvd.core.spec import WorkerId, check_engine_id, check_request_id
from kvd.daemon.config import DaemonConfig
from kvd.daemon.finished_sets import FinishedSets
from kvd.daemon.metrics import Metrics
from kvd.daemon.registration import Registration
from kvd.daemon.registry import Registry

log = logging.getLogger("kvd.daemon")


class Publisher:
    def __init__(self, config: DaemonConfig, registry: Registry, publications: PublicationTable, finished: FinishedSets,
                 metrics: Metrics, auth: AuthConfig) -> None:
        self.config = config
        self.registry = registry
        self.publications = publications
        self.finished = finished
        self.metrics = metrics
        self.auth = auth
        self.draining = False  # set by the daemon: nothing new is published
        self.own_address = ""  # this daemon's gRPC address, as params name it: set once the server is bound
        self.owner = Owner(config.engine_id, registry.host_id, publications,
                           same_host=config.same_host != "off", max_segments_per_read=config.max_segments_per_read)
        # The owner's state is changed on the event loop and read by the data
        # plane's connection threads, which authorise reads without a hop to
        # the loop (a hop costs more than the check): every access holds this.
        self.lock = threading.Lock()
        # Reads of a streaming publication wait on this for their layers;
        # every save and every end wakes them.
        self.saved = threading.Condition(self.lock)
        self._published: dict[str, asyncio.Event] = {}  # request ids a Resolve waits for
        self._waiters: collections.Counter[str] = collections.Counter()  # resolves under way, by request id
        self._resolves = 0

    # ------------------------------------------------------------ gRPC

    def check_caller(self, req: PublishOrder, token: bytes | None) -> None:
        """Who may publish ``req``, and whether this daemon takes it: before
        anything is done for it (with --verify on, digesting its blocks)."""
        if req.worker is not None:
            self.registry.registered(req.worker, token)
        else:
            self.registry.check_engine_token(req.engine_id, token or b"")
        self._check_open(req)

    def publish(self, req: PublishOrder, token: bytes | None = None) -> TransferParams:
        assert req.worker is not None  # a worker's publish (convert.publish_from_pb)
        reg = self.registry.registered(req.worker, token)
        self._check_open(req)
        return self._publish_ranks([reg], req, stream=req.stream)

    def publish_engine(self, req: PublishOrder, token: bytes) -> TransferParams:
        """The engine's scheduler publishes ``req`` for every rank at once
        (vLLM's block ids are the same on every rank). All or nothing: it is
        refused unless every rank of the engine is registered here with the
        same groups, and then no rank can refuse what the first accepted."""
        self.registry.check_engine_token(req.engine_id, token)
        self._check_open(req)
        regs = [self.registry.by_rank[k] for k in sorted(self.registry.by_rank)]
        world = self.registry.world  # check_engine_token found a registration
        if len(regs) != world:
            raise FailedPrecondition(f"only {len(regs)} of the {world} ranks of engine {req.engine_id!r} are registered with this daemon; "
                                     "its workers publish for themselves")
        if gone := [r for r in regs if r.gone]:
            raise FailedPrecondition(f"rank {gone[0].worker} of engine {req.engine_id!r} is gone ({gone[0].gone}): nothing new is published for it")
        shapes = {tuple((g.spec.num_blocks, g.spec.block_size, g.spec.state) for g in r.tensors) for r in regs}
        if len(shapes) > 1:
            raise FailedPrecondition(f"the ranks of engine {req.engine_id!r} registered different KV cache groups; its workers publish for themselves")
        return self._publish_ranks(regs, req, stream=False)

    def _check_open(self, req: PublishOrder) -> None:
        if self.draining:
            raise Unavailable("daemon is draining")
        if req.num_tokens <= 0:
            raise InvalidArgument("num_tokens", req.num_tokens, "must be positive")
        check_lease_seconds("lease_seconds", req.lease_seconds)
        if req.reader_engine_id:  # "": any reader
            check_engine_id("reader_engine_id", req.reader_engine_id)

    def _publish_ranks(self, regs: list[Registration], req: PublishOrder, *, stream: bool) -> TransferParams:
        """``req`` published on the ranks of ``regs`` (one lock hold), what
        that ended reported, the resolves waiting for it woken, and the
        params that offer it."""
        ids = [np.asarray(b.ids, dtype=np.int64) for b in req.block_ids]
        ended: list[Ended] = []
        with self.lock:
            for reg in regs:
                pub, now_ended = self.owner.publish(
                    (reg.worker.tp_rank, reg.worker.pp_rank), req.request_id, ids, reg.tensors, req.num_tokens, time.monotonic(),
                    capability=req.capability, reader_engine_id=req.reader_engine_id, lease_s=req.lease_seconds,
                    first_tokens=[b.first_token for b in req.block_ids], stream=stream, sharing=reg.sharing,
                )
                ended += now_ended
        self.report(ended)
        event = self._published.pop(req.request_id, None)
        if event is not None:
            event.set()
        worker = regs[0].worker
        return TransferParams(
            remote_engine_id=self.config.engine_id, remote_address=self.own_address, remote_epoch=self.registry.epoch,
            request_id=req.request_id, generation=pub.generation, capability=pub.capability,
            block_ids=req.block_ids, num_tokens=req.num_tokens,
            remote_tp_size=worker.tp_size, remote_pp_size=worker.pp_size,
            lease_seconds=req.lease_seconds if req.lease_seconds > 0 else self.config.lease_seconds, stream=stream,
        )

    def layers_saved(self, worker: WorkerId, request_ids: Sequence[str], layers_saved: int, token: bytes | None = None) -> int:
        """A streaming worker wrote every layer below ``layers_saved`` of
        these requests: wake the reads waiting for them."""
        reg = self.registry.registered(worker, token)
        for i, rid in enumerate(request_ids):
            check_request_id(f"request_ids[{i}]", rid)
        if layers_saved > reg.model.num_layers:  # every registered layer is below it (Registry checks): a worker's bug, not progress
            raise InvalidArgument("layers_saved", layers_saved, f"is more than the model's layers (num_layers={reg.model.num_layers})")
        with self.lock:
            advanced = self.owner.layers_saved((reg.worker.tp_rank, reg.worker.pp_rank), list(request_ids), layers_saved)
            # Counted before any read it wakes can land: a reader that has
            # every layer finds them all counted.
            self.metrics.layers_saved.inc(advanced.layers)
            self.metrics.layer_save_reports.inc(len(request_ids))  # a request's last report may come after its read ended
            self.saved.notify_all()
        return advanced.publications

    async def resolve(self, engine_id: str, request_id: str, capability: bytes, wait_seconds: float) -> Resolution:
        """The generation of ``request_id`` published under ``capability``,
        once every rank registered here has published it (or the wait ends
        with at least one). Refused like a read if nothing matches."""
        self.registry.check_peer_engine(engine_id)
        check_request_id("request_id", request_id)
        if self._resolves >= self.config.max_pending_resolves:
            raise ResourceExhausted(f"more than {self.config.max_pending_resolves} resolves pending")
        loop = asyncio.get_running_loop()
        wait = max(0.0, min(wait_seconds, self.config.publish_wait_seconds))
        deadline = loop.time() + wait
        self._resolves += 1
        self._waiters[request_id] += 1
        try:
            while True:
                with self.lock:
                    pub = self.publications.matching(request_id, capability)
                    if pub is None:
                        # Ended (aborted by either side) before this resolve: no use waiting.
                        self.publications.check_not_ended(request_id, capability, time.monotonic())
                    ranks = set(pub.masks) if pub is not None else set()
                if pub is not None and set(self.registry.by_rank) <= ranks:
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    if pub is not None:
                        break  # some ranks published: reads of the others are refused one by one
                    log.info("resolve refused request_id=%s engine=%s: nothing published under its capability within %gs", request_id, engine_id, wait)
                    raise PermissionDenied(f"no publication of request_id={request_id!r} matches this capability (waited {wait:g}s)")
                event = self._published.setdefault(request_id, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            self._resolves -= 1
            # The last resolve of this request id forgets its event: one that was
            # never published must not stay for as long as any other resolve waits.
            self._waiters[request_id] -= 1
            if not self._waiters[request_id]:
                del self._waiters[request_id]
                self._published.pop(request_id, None)
        with self.lock:
            # Every rank of an engine publishes the same block ids (one block table).
            ids = pub.block_ids[min(pub.block_ids)] if pub.block_ids else []
            firsts = pub.first_tokens or (0,) * len(ids)
            blocks = tuple(Blocks(tuple(g.tolist()), f) for g, f in zip(ids, firsts, strict=True))
        return Resolution(pub.generation, self.registry.epoch, len(pub.masks), blocks, pub.num_tokens, pub.stream, pub.lease_s)

    def peer_abort(self, req: PeerAbort) -> bool:
        self.registry.check_peer_engine(req.engine_id)
        check_request_id("request_id", req.request_id)
        with self.lock:
            ended = self.owner.reader_aborted(req.request_id, req.generation, req.capability, req.reason, time.monotonic())
        if ended:
            # As "lease expired" is logged: an operator asking why P let a request go early reads who and why.
            log.info("reader released request_id=%s ranks=%d: %s", req.request_id, len(ended), req.reason or "aborted by the reader")
        self.metrics.reader_releases.inc(len(ended or []))
        self.report(ended or [])
        return ended is not None

    def renew_leases(self, engine_id: str, leases: Sequence[LeaseRef]) -> list[bool]:
        self.registry.check_peer_engine(engine_id)
        for i, lease in enumerate(leases):
            check_request_id(f"leases[{i}].request_id", lease.request_id)
        with self.lock:
            return self.owner.renew([(x.request_id, x.generation, x.capability) for x in leases], time.monotonic())

    def abort(self, request_id: str, rank: tuple[int, int]) -> bool:
        """The local worker ends its own publication."""
        check_request_id("request_id", request_id)
        with self.lock:
            ended = self.publications.abort(request_id, rank)
        self.report(ended)
        return bool(ended)

    def abort_rank(self, rank: tuple[int, int], reason: str) -> None:
        with self.lock:
            ended = self.publications.abort_rank(rank, reason)
        self.report(ended)

    async def sweep(self) -> None:
        """Leases end on their own: every half second, report what expired."""
        while True:
            with self.lock:
                ended = self.publications.expire(time.monotonic())
            for e in ended:
                log.info("lease expired request_id=%s rank=%s", e.request_id, e.rank)
            self.report(ended)
            await asyncio.sleep(0.5)

    def report(self, ended: list[Ended]) -> None:
        # A read waiting for a layer of what ended fails now: also when the
        # end is held back by a pin (then ``ended`` is empty).
        with self.lock:
            self.saved.notify_all()
        for e in ended:
            self.finished.report_sending(e)
        self.metrics.leases_held.set(len(self.publications))
        self.metrics.pinned_ranks.set(self.publications.pinned)

    def forget_idle_readers(self, now: float, connected: set[tuple[str, str]]) -> None:
        """Forget the readers idle for ``peer_idle_seconds`` with no data connection open (``Owner.forget_idle_readers``)."""
        with self.lock:
            gone = self.owner.forget_idle_readers(now, self.config.peer_idle_seconds, connected)
            self.metrics.readers.set(len(self.owner.readers))
        for engine_id, epoch in gone:
            log.info("forgot reader engine=%s epoch=%s: no read, HELLO or handshake for %gs and no data connection open",
                     engine_id, epoch[:8], self.config.peer_idle_seconds)

    # ------------------------------------------------------------ data plane

    def check_hello(self, hello: Hello) -> None:
        try:
            self.owner.check_hello(hello.engine_id, hello.epoch, hello.data_token, self.auth.check_hello_token(hello.shared_token),
                                   time.monotonic())
        except KvdError as e:
            no_handshake = (hello.engine_id, hello.epoch) not in self.owner.readers
            self.metrics.refused_reads.labels("no_handshake" if no_handshake else "unauthenticated").inc()
            raise e from None

    def open_read(self, hello: Hello, read: DataRead, *, local: bool = False, reader_copies: bool = False) -> OpenRead:
        """Authorise ``read`` (from any thread). ``reader_copies``: the
        reader will copy our memory itself (same host, NIXL), so the rank
        stays pinned until the returned read is closed."""
        reg = self.registry.get(read.rank)
        try:
            if reg is not None:
                reg.check_intact()
            with self.lock:
                now = time.monotonic()
                reader = self.owner.reader(hello.engine_id, hello.epoch, now)
                grant = self.owner.authorize(read, reader, reg.tensors if reg is not None else None, now,
                                             local=local, reader_copies=reader_copies, registration=reg.generation if reg is not None else 0)
        except KvdError as e:
            self.metrics.refused_reads.labels(e.status.name.lower()).inc()
            raise
        assert reg is not None
        if local:
            self.metrics.bytes_sent.labels("samehost").inc(sum(segment_nbytes(reg.tensors[s.group_id].spec, s, read.heads_of(s)[1]) for s in read.segments))
        if grant.pin is not None:
            self.metrics.pinned_ranks.set(self.publications.pinned)
        return OpenRead(self, reg, grant)


class OpenRead:
    """An authorised read, as the data plane serves it: each segment's bytes
    (in place or gathered), the liveness check before END, and the ACK."""

    def __init__(self, publisher: Publisher, reg: Registration, grant: Grant) -> None:
        self.publisher, self.reg, self.grant = publisher, reg, grant
        self.read = grant.read
        self.pin: object | None = grant.pin  # the reader copies our memory itself: the rank is pinned until close()
        self._metrics = publisher.metrics
        tensors = reg.tensors
        # A streaming publication: per segment, the layer watermark it needs.
        self._needs = publisher.owner.layer_needs(self.read, tensors) if grant.publication.stream else None

    def wait_saved(self, index: int | None = None) -> None:
        """Block until segment ``index`` (None: every segment) may be
        served: its layers are saved. Raises if the publication ends first,
        or no layer comes within ``layer_wait_seconds``."""
        if self._needs is None:
            return
        need = max(self._needs) if index is None else self._needs[index]
        p = self.publisher
        wait_s = p.config.layer_wait_seconds
        t0 = last_progress = time.monotonic()
        last = -1
        with p.lock:
            while (saved := p.owner.saved_below(self.read, now := time.monotonic())) < need:
                if saved > last:  # the bound is on each layer, not on the whole prefill
                    last, last_progress = saved, now
                remaining = last_progress + wait_s - now
                if remaining <= 0:
                    raise DeadlineExceeded(f"request_id={self.read.request_id!r}: prefill saved no layer past {saved} within "
                                           f"{wait_s:g}s (layer_wait_seconds; layer {need - 1} is needed)")
                p.saved.wait(remaining)
        self._metrics.layer_wait_seconds.inc(time.monotonic() - t0)

    def saved(self, index: int | None = None) -> bool:
        """Segment ``index``'s layers (None: every segment's) are saved now."""
        if self._needs is None:
            return True
        need = max(self._needs) if index is None else self._needs[index]
        with self.publisher.lock:
            return self.publisher.owner.saved_below(self.read, time.monotonic()) >= need

    def _seg(self, index: int):  # type: ignore[no-untyped-def]
        seg = self.read.segments[index]
        return self.reg.tensors[seg.group_id], seg

    def segment(self, index: int, staging: GatherStaging, transport: str = "tcp") -> torch.Tensor:
        group, seg = self._seg(index)
        payload = serve_segment(group, seg, *self.read.heads_of(seg), staging)
        self.count_sent(payload.numel(), seg.block_count, transport)
        return payload

    def count_sent(self, nbytes: int, blocks: int, transport: str) -> None:
        """Metrics for segments that left without ``segment`` (exposed in place)."""
        self._metrics.bytes_sent.labels(transport).inc(nbytes)
        self._metrics.blocks_sent.labels(transport).inc(blocks)

    def served(self, seconds: float) -> None:
        """The data plane sent this read's END ``seconds`` after its READ came in."""
        self._metrics.read_serve_seconds.observe(seconds)

    def segment_blocks(self, index: int) -> int:
        return self.read.segments[index].block_count

    def segment_device(self, index: int) -> torch.device:
        return self._seg(index)[0].device

    def segment_nbytes(self, index: int) -> int:
        group, seg = self._seg(index)
        return segment_nbytes(group.spec, seg, self.read.heads_of(seg)[1])

    def segment_pieces(self, index: int) -> tuple[np.ndarray, int] | None:
        """A batched segment's bytes as equal pieces of registered memory, in wire order."""
        group, seg = self._seg(index)
        return batched_pieces(group, seg, *self.read.heads_of(seg))

    def segment_iov(self, index: int) -> np.ndarray | None:
        """The segment's registered host memory as an iovec array, in wire order."""
        group, seg = self._seg(index)
        return owner_iov(group, seg, *self.read.heads_of(seg))

    def segment_view(self, index: int) -> torch.Tensor | None:
        """The segment as a zero-copy view of registered memory, or None when it must be gathered."""
        group, seg = self._seg(index)
        return segment_view(group, seg, *self.read.heads_of(seg))

    def check_alive(self) -> None:
        """Raise if the publication ended (aborted, expired) while being served.
        Called from data-plane threads too: a dict lookup and a compare."""
        with self.publisher.lock:
            self.publisher.owner.check_alive(self.read, time.monotonic())

    def acknowledged(self) -> None:
        """The reader's ACK (on the event loop): every byte landed."""
        self.close()
        mine = self.publisher.registry.engine_meta()
        with self.publisher.lock:
            ended = self.publisher.owner.acknowledged(self.grant, mine)
        self.publisher.report(ended)

    def close(self) -> None:
        """The read is over, one way or another (on the event loop)."""
        pin, self.pin = self.pin, None
        if pin is not None:
            with self.publisher.lock:
                ended = self.publisher.owner.release(self.grant)
            self.publisher.report(ended)
