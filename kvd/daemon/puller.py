"""The decode side of the daemon shell: pulls, run as background tasks.

``Puller`` takes a worker's Pull, resolves and handshakes as needed, plans
with ``kvd.core.transfer.plan_pull``, keeps the pull's state in the pure
``PullProgress`` (what landed across attempts, exactly which blocks did not)
and asks ``RetryPolicy`` whether to try again; the transport moves the bytes.
``Heartbeat`` keeps P's leases alive while they wait or run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import grpc
import numpy as np

from kvd.core.addresses import check_address
from kvd.core.aggregate import Outcome
from kvd.core.digest import VerifyMismatch
from kvd.core.engine_meta import LAYER_STREAM, EngineMeta
from kvd.core.errors import FailedPrecondition, Incompatible, InvalidArgument, KvdError, Unavailable
from kvd.core.groups import WINDOWED
from kvd.core.leases import RankKey, check_block_ids, check_disjoint, check_lease_seconds
from kvd.core.pairing import engine_shape
from kvd.core.pieces import copy_blocks
from kvd.core.pull import PullProgress, RetryPolicy, Striping
from kvd.core.qos import QosTag, ms_left
from kvd.core.reader_release import PublicationKey, ReaderRelease, publication
from kvd.core.requests import PeerAbort, PullOrder, TransferParams
from kvd.core.spec import WorkerId, check_engine_id, check_request_id
from kvd.core.topology import fanout_source
from kvd.core.transfer import plan_pull, skipped_bytes
from kvd.daemon import landing_fault
from kvd.daemon.active_pull import ActivePull, Failure, failure_reason
from kvd.daemon.config import DaemonConfig
from kvd.daemon.finished_sets import FinishedSets
from kvd.daemon.heartbeat import Heartbeat
from kvd.daemon.metrics import ActiveClock, Metrics
from kvd.daemon.outbound import PeerChannels, Tasks
from kvd.daemon.peers import Handshakes
from kvd.daemon.registration import Registration
from kvd.daemon.registry import Registry
from kvd.daemon.resolver import Resolver
from kvd.daemon.segment_size import segment_bytes
from kvd.daemon.verifier import Verifier
from kvd.transport.tcp_client import TcpDataClient

log = logging.getLogger("kvd.daemon")

PLAN_IN_THREAD_BLOCKS = 2048  # about 1 ms of planning


class Puller:
    def __init__(self, config: DaemonConfig, registry: Registry, finished: FinishedSets, handshakes: Handshakes,
                 data_client: TcpDataClient, channels: PeerChannels, tasks: Tasks, metrics: Metrics, verifier: Verifier) -> None:
        self.config = config
        self.registry = registry
        self.finished = finished
        self.handshakes = handshakes
        self.data_client = data_client
        self.channels = channels
        self.tasks = tasks
        self.metrics = metrics
        self.verifier = verifier
        self.landing_fault = landing_fault.from_env()  # tests only: what verification must catch
        self.active_clock = ActiveClock(metrics.active_seconds)
        self.draining = False  # set by the daemon: nothing new is pulled
        self.pulls: dict[tuple[RankKey, str], ActivePull] = {}
        self.readers = ReaderRelease()  # P hears that we gave up once our last rank reading it ended
        self.recent_failures: collections.deque[Failure] = collections.deque(maxlen=32)
        self.retry = RetryPolicy(retries=config.pull_retries)
        self.striping = (Striping(config.stripes_per_read, config.stripe_min_bytes, config.qos_read_bytes if config.qos_on else 0)
                         if config.transport == "tcp" else Striping())
        self._slots = asyncio.Semaphore(config.max_concurrent_pulls)
        self.resolver = Resolver(channels, config.publish_wait_seconds, config.max_concurrent_pulls)
        # Kept for 2 x pull_timeout after each pull, so compact: numpy ids (a Python list of
        # 1024 ids is ~37 KB; at a few hundred pulls a second the lists alone held hundreds of MB).
        self._replica_done: dict[tuple[str, bytes, RankKey], asyncio.Future[list[np.ndarray]]] = {}
        self.heartbeat = Heartbeat(config.engine_id, self.pulls, channels, tasks,
                                   lambda p: self._replica_source((p.worker.tp_rank, p.worker.pp_rank)) is None)

    # ------------------------------------------------------------ gRPC

    def pull(self, req: PullOrder, token: bytes | None = None) -> None:
        """Accept ``req`` and run it in the background (its outcome goes to the worker's finished sets)."""
        reg = self.registry.registered(req.worker, token)
        if self.draining:
            raise Unavailable("daemon is draining")
        p = req.params
        check_request_id("request_id", req.request_id)
        check_request_id("params.request_id", p.request_id)
        check_engine_id("params.remote_engine_id", p.remote_engine_id)
        check_lease_seconds("params.lease_seconds", p.lease_seconds)  # paces the renewals: inf would make none
        if p.remote_engine_id == self.config.engine_id:
            raise InvalidArgument("params.remote_engine_id", p.remote_engine_id, "is this daemon's own engine")
        check_address("params.remote_address", p.remote_address)
        if p.num_tokens <= 0:
            raise InvalidArgument("params.num_tokens", p.num_tokens, "must be positive")
        if len(req.local) != len(reg.groups):
            raise InvalidArgument("local_block_ids", f"<{len(req.local)} groups>", f"must give one list per KV cache group ({len(reg.groups)})")
        local = [np.asarray(ids.ids, dtype=np.int64) for ids in req.local]
        for g, ids, arr in zip(reg.groups, req.local, local, strict=True):
            check_block_ids(f"local_block_ids[{g.group_id}]", arr, g.spec.num_blocks)
            if ids.first_token % g.spec.block_size or ids.first_token > p.num_tokens:
                raise InvalidArgument(f"local_block_ids[{g.group_id}].first_token", ids.first_token,
                                      f"must be a multiple of the block size {g.spec.block_size}, at most params.num_tokens={p.num_tokens}")
        check_disjoint("local_block_ids", local, reg.sharing)
        worker = reg.worker
        key = ((worker.tp_rank, worker.pp_rank), req.request_id)
        if key in self.pulls:
            raise FailedPrecondition(f"request_id={req.request_id!r} is already being pulled by {worker}")
        now = time.monotonic()
        qos = QosTag.of(req.priority, req.tenant, req.deadline_ms, now, self.config.shares)
        # Renewed at the next heartbeat (kvd.daemon.heartbeat): P's lease has run since it published.
        active = ActivePull(worker, req, p, now, next_renew=now, accepted=time.perf_counter(), qos=qos)
        active.task = asyncio.create_task(self._run(reg, active))
        self.pulls[key] = active
        self.readers.started(p, key[0])
        active.task.add_done_callback(lambda _t: self._ended(key, active))

    def abort(self, worker: WorkerId, request_id: str, release: TransferParams | None, rank: RankKey) -> bool:
        """D cancels its pull; with ``release``, P frees blocks D will not read. P
        hears either once no pull here reads that publication (``ReaderRelease``)."""
        found = False
        active = self.pulls.get((rank, request_id))
        if active is not None and active.task is not None:
            active.gave_up = active.gave_up or f"reader {self.config.engine_id} aborted"  # told P when its siblings end too
            active.cancel(f"aborted by {worker}", "aborted")
            found = True
        if release is not None and release.remote_address:
            self._release_after(publication(release), self.readers.give_up(release, rank, self.registry.live_ranks(),
                                                                            f"reader {self.config.engine_id} does not need it"))
            found = True
        return found

    def cancel_rank(self, rank: RankKey) -> None:
        """The worker left or restarted: its pulls would land in memory it no longer owns."""
        for (r, _), active in list(self.pulls.items()):
            if r == rank and active.task is not None:
                active.task.cancel()

    # ------------------------------------------------------------ one pull

    async def _run(self, reg: Registration, active: ActivePull) -> None:
        active.ran = True
        req = active.request
        rank = (reg.worker.tp_rank, reg.worker.pp_rank)
        local_ids = [list(b.ids) for b in req.local]
        progress = active.progress
        t0 = time.perf_counter()
        self.metrics.pulls_in_flight.inc()
        phase = self.metrics.pull_phase_seconds
        try:
            source = self._replica_source(rank)
            if source is not None:
                # A replica waits for its source rank's pull before it takes a slot: holding one, a burst
                # of replicas could fill them all while their sources queue behind them, and nothing moves
                # until they time out. Its wait counts against its timeout; the copy follows at once.
                progress.phase = "copy"
                async with asyncio.timeout(self.config.pull_timeout_seconds):
                    await asyncio.wait({self._replica_future(active.params, (source, rank[1]))})
            elif self._slots.locked() and not active.params.generation:
                active.resolving = asyncio.create_task(self.resolver.while_queued(active))
            async with self._slots:
                t0 = time.perf_counter()
                phase.labels("queued").observe(t0 - active.accepted)
                # asyncio.timeout, not wait_for: on 3.11 wait_for runs the pull as a task of its own, a turn of the loop before its first step.
                async with asyncio.timeout(self.config.pull_timeout_seconds):
                    asked = self.verifier.ask_early(self.channels, reg, req, active.params)
                    try:
                        total = await self._with_retries(reg, active, rank, local_ids, progress)
                        landing_fault.after_landing(self.landing_fault, reg.tensors, req.local)
                    except BaseException:
                        if asked is not None:
                            asked.cancel()
                        raise
                    if asked is not None:
                        progress.phase = "verify"
                        await self.verifier.verify_landed(self.channels, reg, req, active.params, asked)
            landed_at = time.perf_counter()
            landed = self._replica_future(active.params, rank)
            if not landed.done():
                landed.set_result([np.asarray(b.ids, dtype=np.int64) for b in req.local])  # compact: kept a while
            self.metrics.transfer_seconds.labels("done").observe(time.perf_counter() - t0)
            self._count_window_savings(reg, active)
            self.finished.emit(rank, Outcome(req.request_id, "recving", "done", bytes=total))
            phase.labels("report").observe(time.perf_counter() - landed_at)
        except BaseException as e:
            reason, message = failure_reason(e)
            outcome = "failed"
            if isinstance(e, asyncio.CancelledError) and active.cancel_reason:
                outcome, message = active.cancel_outcome, active.cancel_reason
                reason = "aborted" if outcome == "aborted" else "lease_lost"  # the heartbeat's cancel
            if reason == "timeout":
                message = f"pull timed out after {time.perf_counter() - active.accepted:.1f}s (pull_timeout_seconds={self.config.pull_timeout_seconds:g})"
            # Which peer, where it stopped and what landed: the one line an operator needs.
            p = active.params
            message = f"{message} [engine {p.remote_engine_id!r} at {p.remote_address}, {progress.where()}]"
            invalid = e.invalid if isinstance(e, VerifyMismatch) else progress.invalid_blocks(sorted({i for ids in local_ids for i in ids}))
            # Replicas copying from us fail now, even those that ask later.
            fut = self._replica_future(p, rank)
            if not fut.done():
                fut.set_exception(FailedPrecondition(message))
                fut.exception()  # nobody may be waiting; don't warn about it
            self.metrics.failures.labels(reason).inc()
            self.metrics.transfer_seconds.labels("failed").observe(time.perf_counter() - t0)
            self.recent_failures.append(Failure(req.request_id, reason, message, time.monotonic()))
            self.finished.emit(rank, Outcome(req.request_id, "recving", outcome, message), invalid)
            if outcome == "failed" and not active.lease_gone:
                # The engine recomputes what it could not load: P need not hold the blocks to its
                # lease (told once this daemon's last reader of them ends), unless P said it ended them.
                active.gave_up = active.gave_up or f"reader {self.config.engine_id} failed to load it: {message}"
            log.warning("pull failed request_id=%s worker=%s reason=%s invalid_blocks=%d: %s", req.request_id, reg.worker, reason, len(invalid), message)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            if active.resolving is not None:
                active.resolving.cancel()
            self.metrics.pulls_in_flight.dec()

    async def _with_retries(self, reg: Registration, active: ActivePull, rank: RankKey, local_ids: list[list[int]],
                            progress: PullProgress) -> int:
        attempt = 0
        while True:
            try:
                return await self._attempt(reg, active, rank, local_ids, progress)
            except (ConnectionError, OSError, Unavailable) as e:
                # Transient: the peer may have restarted. Forget what we knew
                # (handshake, pooled connections) and try again, boundedly.
                await self.handshakes.forget(active.params.remote_engine_id)
                delay = self.retry.delay(attempt, transient=True)
                if delay is None:
                    raise
                log.info("retrying pull request_id=%s after %s: %s", active.request.request_id, type(e).__name__, e)
                await asyncio.sleep(delay)
                attempt += 1

    def _count_window_savings(self, reg: Registration, active: ActivePull) -> None:
        """What the window groups of a pull that landed did not move, against
        full attention from the prefix decode already held."""
        firsts = [b.first_token for b in active.request.local]
        for g, first in zip(reg.groups, firsts, strict=True):
            if g.kind.name in WINDOWED:
                self.metrics.window_skipped.labels(g.kind.name).inc(skipped_bytes(g, active.params.num_tokens, first, min(firsts)))

    async def _attempt(self, reg: Registration, active: ActivePull, rank: RankKey, local_ids: list[list[int]],
                       progress: PullProgress) -> int:
        req = active.request
        local_meta = self.registry.engine_meta()
        source = self._replica_source(rank, local_meta)
        if source is not None:
            progress.phase = "copy"
            return await self._copy_from_replica(reg, active, (source, rank[1]), local_ids)
        phase = self.metrics.pull_phase_seconds
        if active.resolving is not None or not active.params.generation:
            progress.phase = "resolve"  # which also ends the queued pull's own tries
            t = time.perf_counter()
            if active.resolving is not None:
                active.resolving.cancel()  # still trying: its next answer would be this one's
                active.resolving = None
            if not active.params.generation:
                # Before the handshake: it fills in the epoch the handshake is cached by.
                active.params = await self.resolver.resolve(active.params)
            phase.labels("resolve").observe(time.perf_counter() - t)
        params = active.params
        progress.phase = "handshake"
        t = time.perf_counter()
        peer = await self.handshakes.peer_for(params)
        phase.labels("handshake").observe(time.perf_counter() - t)
        progress.phase = "plan"
        t = time.perf_counter()
        if peer.meta.epoch != params.remote_epoch:
            raise FailedPrecondition(
                f"remote engine {params.remote_engine_id!r} restarted: params epoch {params.remote_epoch[:8]} != current {peer.meta.epoch[:8]}; its publication is gone"
            )
        offer = params.offer()
        if offer.stream and LAYER_STREAM not in peer.meta.features:
            raise FailedPrecondition(f"params.stream: engine {params.remote_engine_id!r} does not serve layer-wise streaming "
                                     f"(its features: {list(peer.meta.features)})")
        reg.check_intact()  # we write into them: checked before planning, so a shrunk region plans nothing
        blocks = sum(len(ids) for ids in local_ids)
        for fresh in (False, True):
            cut = progress.cut(segment_bytes(self.config, self.data_client, reg, peer))  # a retry's: its first attempt's
            plan = functools.partial(
                plan_pull, local_meta=local_meta, local_tp_rank=rank[0], local_pp_rank=rank[1],
                local_groups=reg.tensors, local_group_specs=reg.groups, remote=peer.meta, params=offer,
                local_block_ids=local_ids, segment_bytes=cut,
                local_first_tokens=[b.first_token for b in req.local],
            )
            try:
                # Planning costs ~0.4 us a block: a big pull's (40 ms at 100k
                # blocks) runs in a thread, so every other call is answered
                # meanwhile; a small one's stays here (a thread hop costs more).
                reads = await asyncio.to_thread(plan) if blocks >= PLAN_IN_THREAD_BLOCKS else plan()
                break
            except Incompatible as e:
                if fresh or "not registered" not in e.message:
                    raise
                # Our view of the remote engine predates a rank it registered since: look again.
                self.handshakes.drop_peer(params.remote_engine_id)
                peer = await self.handshakes.peer_for(params)
        phase.labels("plan").observe(time.perf_counter() - t)
        progress.phase = "data"
        t = time.perf_counter()
        todo = progress.begin(reads, self.striping.for_owner(peer.meta.features), frozenset(peer.local_sources), cut)
        if not progress.reads:
            # Decode needs none of it (its first token is past every block): no read will acknowledge
            # it, so P is told, or it would hold the blocks for nobody until the lease ends.
            active.gave_up = active.gave_up or f"reader {self.config.engine_id} needed none of it"
        self._replica_future(params, rank)  # replicas may wait on us
        planned = progress.bytes_planned(todo)
        self.metrics.bytes_in_flight.inc(planned)
        sources = [peer.local_sources.get(rr.read.rank) if rr.read.rank in progress.local else None for rr in progress.reads]
        self.active_clock.start()
        try:
            now = time.monotonic()
            tagged = {i: dataclasses.replace(progress.reads[i].read, priority=active.qos.priority, tenant=active.qos.tenant,
                                             deadline_ms=ms_left(active.qos, now)) for i in todo}  # for the owner's sends
            tasks = {i: asyncio.ensure_future(self.data_client.read(peer.meta.data_address, tagged[i], progress.reads[i].sinks,
                                                                 progress.landed[i], sources[i], active.qos))
                     for i in todo}
            try:
                if tasks:  # none where the plan leaves nothing to read (asyncio.wait refuses an empty set)
                    await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
            finally:
                # One read failed (or we were cancelled): stop the others and wait
                # until they have, so nothing lands after the failure is reported.
                pending = [task for task in tasks.values() if not task.done()]
                for task in pending:
                    task.cancel()
                if pending:  # (an await costs a turn of the loop even when all are done)
                    await asyncio.gather(*pending, return_exceptions=True)
                self._count_landed(progress, progress.settle(list(tasks)), sources)
            # Report the read that failed, not a sibling we cancelled because of it.
            failed = [task.exception() for task in tasks.values() if not task.cancelled() and task.exception() is not None]
            if failed:
                raise failed[0]  # type: ignore[misc]
            phase.labels("transfer").observe(time.perf_counter() - t)
        finally:
            self.active_clock.stop()
            self.metrics.bytes_in_flight.dec(planned)
        return progress.moved

    def _count_landed(self, progress: PullProgress, newly: list[int], sources: Sequence[object]) -> None:
        m = self.metrics
        blocks: dict[str, list[np.ndarray]] = {}
        for i in newly:
            transport = "samehost" if sources[i] is not None else self.config.transport
            m.data_reads.labels(transport).inc()
            m.bytes_received.labels(transport).inc(progress.reads[i].nbytes)
            blocks.setdefault(transport, []).extend(np.asarray(s.local_block_ids) for s in progress.reads[i].sinks)
        for transport, ids in blocks.items():  # a block filled by several reads (ranks, stripes) counts once
            every = np.concatenate(ids)
            if every.size:  # ids are below the registered block count: a mask, not a sort
                seen = np.zeros(int(every.max()) + 1, dtype=bool)
                seen[every] = True
                m.blocks_received.labels(transport).inc(int(np.count_nonzero(seen)))

    # ------------------------------------------------------------ replicas

    def _replica_future(self, params: TransferParams, rank: RankKey) -> asyncio.Future[list[np.ndarray]]:
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

    def _replica_source(self, rank: RankKey, meta: EngineMeta | None = None) -> int | None:
        """The local TP rank ``rank`` copies its KV from (a replica of the same heads), or None: it reads P."""
        meta = meta or self.registry.engine_meta()
        return fanout_source(engine_shape(meta), rank[0], rank[1], frozenset((r.tp_rank, r.pp_rank) for r in meta.ranks))

    async def _copy_from_replica(self, reg: Registration, active: ActivePull, source: RankKey, local_ids: list[list[int]]) -> int:
        """Copy a request's blocks from the replica that read them, instead of
        reading the same remote bytes again."""
        req = active.request
        fut = self._replica_future(active.params, source)
        try:
            src_ids = [ids.tolist() for ids in await asyncio.wait_for(asyncio.shield(fut), self.config.pull_timeout_seconds)]
        except KvdError as e:
            raise FailedPrecondition(f"replica tp{source[0]}/pp{source[1]} failed to pull request_id={req.request_id!r}: {e.message}") from None
        src_reg = self.registry.get(source)
        if src_reg is None:
            raise FailedPrecondition(f"replica tp{source[0]}/pp{source[1]} is no longer registered")
        work = asyncio.get_running_loop().run_in_executor(None, copy_blocks, src_reg.tensors, src_ids, reg.tensors, local_ids, active.params.num_tokens)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await work  # the copy is short; let it end before the failure is reported
            raise

    def _ended(self, key: tuple[RankKey, str], active: ActivePull) -> None:
        """A pull's task is done, however (even cancelled before its first step)."""
        self.pulls.pop(key, None)
        gave_up = active.gave_up or ("" if active.ran else f"reader {self.config.engine_id} cancelled it before it started")
        self._release_after(publication(active.params), self.readers.ended(active.params, key[0], self.registry.live_ranks(), gave_up))

    def _release_after(self, key: PublicationKey, delay: float | None) -> None:
        """Tell P that no rank here reads ``key`` any more, ``delay`` seconds from now (None: nothing to tell)."""
        def due() -> None:
            release = self.readers.due(key)
            if release is not None:
                self.tasks.spawn(self._abort_remote(release.params, release.reason))
        if delay == 0.0:
            due()
        elif delay is not None:
            asyncio.get_running_loop().call_later(delay, due)

    # ------------------------------------------------------------ talking to P

    async def _abort_remote(self, params: TransferParams, reason: str) -> None:
        """Best effort: let P release the lease now rather than at expiry."""
        try:
            await self.channels.abort(params.remote_address, PeerAbort(params.remote_engine_id, params.request_id, params.generation,
                                                                       params.capability, reason), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.info("peer abort of request_id=%s not delivered: %s", params.request_id, e.code().name)
