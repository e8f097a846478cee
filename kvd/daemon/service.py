"""The gRPC shell: translate RPCs into Daemon calls and KvdErrors into statuses.

Each request becomes the core's dataclasses here, once (``kvd.convert``),
and each answer protobuf again; the daemon's parts never see a message."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvd import __version__
from kvd.auth import WORKER_TOKEN_HEADER, TokenInterceptor, is_local_peer
from kvd.convert import (
    digest_answer_to_pb,
    digest_query_from_pb,
    engine_to_pb,
    finished_to_pb,
    introduction_from_pb,
    leases_from_pb,
    params_from_pb,
    params_to_pb,
    peer_abort_from_pb,
    publish_engine_from_pb,
    publish_from_pb,
    pull_from_pb,
    registered_to_pb,
    registering_from_pb,
    report_from_pb,
    resolution_to_pb,
    worker_from_pb,
    worker_to_pb,
)
from kvd.core.aggregate import WorkerFinished
from kvd.core.errors import InvalidArgument, KvdError, PermissionDenied, ResourceExhausted
from kvd.core.requests import PublishOrder, ShmSource, TransferParams
from kvd.daemon.caller_uid import tcp_caller_uid
from kvd.daemon.daemon import Daemon
from kvd.daemon.registration import Registration
from kvd.daemon.reports import REPORT_BATCH
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg

log = logging.getLogger("kvd.service")
# Past this a publication's computed_at stamp is another clock's, not a delay.
PUBLISH_DELAY_PLAUSIBLE_S = 3600.0

T = TypeVar("T")

# Control messages are small; a registration of thousands of layers is < 1 MiB.
MAX_MESSAGE_BYTES = 16 << 20
# Per client connection (HTTP/2), so per peer: bounds what one peer can hold open.
MAX_CONCURRENT_STREAMS = 256


class BadRequest:
    """A request body that did not decode as its message type."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"request: not a valid {type_name} ({error})"


def _deserializer(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError, or worse: answered as INVALID_ARGUMENT
            return BadRequest(cls.DESCRIPTOR.full_name, e)

    return parse


def register_service(server: grpc.aio.Server, servicer: Any, name: str) -> None:
    """Register a servicer from the proto descriptor, so an undecodable request
    gets INVALID_ARGUMENT from our handler instead of UNKNOWN from grpc."""
    desc = pb.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for m in desc.methods:
        kind = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = kind(getattr(servicer, m.name), request_deserializer=_deserializer(getattr(pb, m.input_type.name)),
                                response_serializer=lambda msg: msg.SerializeToString())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))


def grpc_code(e: KvdError) -> grpc.StatusCode:
    """The core's status as gRPC's: the names are the same by design."""
    return grpc.StatusCode[e.status.name]


def rpc(fn: Callable[..., T]) -> Callable[..., Awaitable[T]]:
    """Run a handler; a KvdError becomes its gRPC status with its message."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            result = fn(self, request, context)
            if hasattr(result, "__await__"):
                result = await result  # type: ignore[misc]
            return result
        except KvdError as e:
            await context.abort(grpc_code(e), e.message)
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable")

    return wrapper


def worker_token(context: grpc.aio.ServicerContext) -> bytes:
    for key, value in context.invocation_metadata() or ():
        if key == WORKER_TOKEN_HEADER:
            if not isinstance(value, str):
                return bytes(value)
            try:
                return bytes.fromhex(value)
            except ValueError:  # its length only: a token sent wrong may still be a secret
                raise InvalidArgument(WORKER_TOKEN_HEADER, f"<{len(value)} characters>",
                                      "is not hex: send the worker_token that Register answered, hex-encoded") from None
    return b""


class WorkerService(pbg.WorkerServicer):
    """The local API: only for workers on this host, each only for itself."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def _local(self, context: grpc.aio.ServicerContext) -> bytes:
        if self.d.config.worker_api == "local" and not is_local_peer(context.peer()):
            raise PermissionDenied(f"the worker API only serves this host (peer {context.peer()}); set worker_api=any to open it")
        return worker_token(context)

    @rpc
    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        self._local(context)
        registering = registering_from_pb(request)
        caller = None  # CUDA IPC handles name no file of another user's; an alive token does
        if registering.alive_shm or any(isinstance(r.source, ShmSource) for r in registering.regions):
            # The kernel walks every socket in the namespace for the dump: off the loop.
            caller = await asyncio.to_thread(tcp_caller_uid, context.peer(), self.d.config.grpc_port)
        return registered_to_pb(await self.d.registry.register(registering, caller))

    @rpc
    def Unregister(self, request: pb.UnregisterRequest, context: Any) -> pb.UnregisterResponse:
        self.d.registry.unregister(worker_from_pb(request.worker), self._local(context))
        return pb.UnregisterResponse()

    @rpc
    async def Publish(self, request: pb.PublishRequest, context: Any) -> pb.PublishResponse:
        token = self._local(context)
        order = publish_from_pb(request)
        assert order.worker is not None
        reg = self.d.registry.by_rank.get((order.worker.tp_rank, order.worker.pp_rank))
        resp = await self._publish([reg] if reg is not None else [], order, token, lambda: self.d.publisher.publish(order, token))
        self._observe_publish_delay("worker", request.computed_at_unix_nanos)
        return resp

    @rpc
    async def PublishEngine(self, request: pb.PublishEngineRequest, context: Any) -> pb.PublishResponse:
        token = self._local(context)
        order = publish_engine_from_pb(request)
        regs = [self.d.registry.by_rank[k] for k in sorted(self.d.registry.by_rank)]
        resp = await self._publish(regs, order, token, lambda: self.d.publisher.publish_engine(order, token))
        self._observe_publish_delay("engine", request.computed_at_unix_nanos)
        return resp

    def _observe_publish_delay(self, by: str, computed_at_ns: int) -> None:
        """A stamp is a hint for the metric, not part of the publication: one
        that is absent (0) or implausible (ahead of this clock, or over an
        hour old: another host's clock) is not observed, not refused."""
        delay = (time.time_ns() - computed_at_ns) / 1e9
        if computed_at_ns and 0 <= delay <= PUBLISH_DELAY_PLAUSIBLE_S:
            self.d.metrics.publish_delay_seconds.labels(by).observe(delay)

    async def _publish(self, regs: list[Registration], order: PublishOrder, token: bytes | None,
                       publish: Callable[[], TransferParams]) -> pb.PublishResponse:
        """Publish ``order`` on ``regs``; with verification on, their blocks as
        published are digested first, before any reader can see them."""
        self.d.verifier.mode_of(order)  # a bad mode is refused by name before anything is published
        self.d.publisher.check_caller(order, token)  # nothing is digested for a caller that may not publish
        digests = await self.d.verifier.digest(regs, order)
        params = publish()
        self.d.verifier.keep(regs, digests, params)
        return pb.PublishResponse(params=params_to_pb(params))

    @rpc
    def LayersSaved(self, request: pb.LayersSavedRequest, context: Any) -> pb.LayersSavedResponse:
        token = self._local(context)
        return pb.LayersSavedResponse(advanced=self.d.publisher.layers_saved(worker_from_pb(request.worker), list(request.request_ids),
                                                                             request.layers_saved, token))

    @rpc
    def Pull(self, request: pb.PullRequest, context: Any) -> pb.PullResponse:
        token = self._local(context)
        self.d.puller.pull(pull_from_pb(request), token)
        return pb.PullResponse(accepted=True)

    @rpc
    def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        token = self._local(context)
        release = params_from_pb(request.release) if request.HasField("release") else None
        return pb.AbortResponse(found=self.d.abort(worker_from_pb(request.worker), request.request_id, release, token))

    @rpc
    def GetFinished(self, request: pb.GetFinishedRequest, context: Any) -> pb.GetFinishedResponse:
        worker = worker_from_pb(request.worker)
        self.d.registry.registered(worker, self._local(context))
        # At most REPORT_BATCH outcomes an answer (the rest at the next call): a
        # box that filled while nobody read it would pass gRPC's 16 MiB limit.
        return finished_to_pb(self.d.finished.box((worker.tp_rank, worker.pp_rank)).take(REPORT_BATCH))

    async def WatchFinished(self, request: pb.GetFinishedRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetFinishedResponse]:
        """GetFinished pushed: the worker's engine step reads what arrived
        instead of waiting on a round trip. A resumed stream first gets what
        the broken one may have lost; then the backlog (even empty: it confirms
        the subscription), then the box each time an outcome lands."""
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            worker = worker_from_pb(request.worker)
            reg = self.d.registry.registered(worker, self._local(context))
        except KvdError as e:
            await context.abort(grpc_code(e), e.message)
        key = (worker.tp_rank, worker.pp_rank)
        box, log = self.d.finished.box(key), reg.pushed
        me = log.claim()
        box.wake()  # an older stream of this worker stops: it may be broken and not know it yet
        missed = log.since(request.resume_after) if request.HasField("resume_after") else []
        if missed is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot resume after push {request.resume_after}: "
                                f"pushes up to {log.last_seq} were made, not all of them are still held")
        for seq, sets in missed or ():
            yield finished_to_pb(sets, seq)
        wake = asyncio.Event()
        box.watchers.append(wake.set)
        try:
            first = True
            # Another registration of this rank (or none), or a newer stream, owns the box from then on.
            while self.d.registry.get(key) is reg and log.owner == me:
                wake.clear()  # before taking: an outcome added after it sets it again
                # At most REPORT_BATCH outcomes a push: a whole box that filled while
                # the worker lagged could pass gRPC's 16 MiB limit, and be resent so forever.
                out = box.take(REPORT_BATCH)
                if first or not out.empty:
                    first = False
                    if not box.empty:
                        wake.set()  # the rest without waiting for more
                    # Logged before it is sent: if the send is lost, a resumed stream resends it.
                    yield finished_to_pb(out, log.push(out))
                elif self.d.streams_ending:
                    return
                else:
                    await wake.wait()
        finally:
            box.watchers.remove(wake.set)

    @rpc
    def GetEngineFinished(self, request: pb.EngineFinishedRequest, context: Any) -> pb.GetFinishedResponse:
        self.d.registry.check_engine_token(request.engine_id, self._local(context))
        return finished_to_pb(self.d.finished.engine_hub.take(REPORT_BATCH))  # as GetFinished: the rest at the next call

    async def WatchEngineFinished(self, request: pb.EngineFinishedRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetFinishedResponse]:
        """Push the engine's merged sets as requests complete; nobody polls."""
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            self.d.registry.check_engine_token(request.engine_id, self._local(context))
        except KvdError as e:
            await context.abort(grpc_code(e), e.message)
        # What this stream has not sent yet, merged as it comes and bounded like
        # every other box: a scheduler that stops reading (its send blocks on
        # the stream's window) costs the daemon at most MAX_UNREAD outcomes.
        box = self.d.finished.engine_hub.drain()
        wake = asyncio.Event()
        box.watchers.append(wake.set)

        def merge(sets: WorkerFinished) -> None:
            box.extend(sets)  # wakes the stream, also for the empty set that cues its end
            if dropped := box.bound():
                self.d.metrics.unread_dropped.labels("engine").inc(dropped)

        hub = self.d.finished.engine_hub
        hub.subscribers.append(merge)
        try:
            while True:
                wake.clear()  # before taking: sets merged after it set it again
                # At most REPORT_BATCH outcomes a message: a box that filled while
                # the reader lagged would pass gRPC's message size limit whole.
                out = box.take(REPORT_BATCH)
                if not out.empty:
                    yield finished_to_pb(out)
                    wake.set()  # the rest of the box, if any, without waiting for more
                elif self.d.streams_ending:
                    return  # opened after the drain's cue to end, or past it: nothing more will come
                else:
                    await wake.wait()
        finally:
            hub.subscribers.remove(merge)
            if not hub.subscribers and not box.empty and (dropped := hub.keep(box)):  # unsent, no other stream had it: for the next reader
                self.d.metrics.unread_dropped.labels("engine").inc(dropped)

    @rpc
    def SetExpectedFinishedCount(self, request: pb.SetExpectedFinishedCountRequest, context: Any) -> pb.SetExpectedFinishedCountResponse:
        self.d.registry.check_engine_token(request.engine_id, self._local(context))
        world = self.d.registry.world
        if request.expected_finished_count > world:  # more than can ever report: no request would finish
            raise InvalidArgument("expected_finished_count", request.expected_finished_count,
                                  f"exceeds engine {request.engine_id!r}'s {world} workers (tp_size x pp_size); 0: all of them")
        return pb.SetExpectedFinishedCountResponse(expected_finished_count=self.d.finished.set_expected(
            request.expected_finished_count, world))


class PeerService(pbg.PeerServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    @rpc
    async def Handshake(self, request: pb.HandshakeRequest, context: Any) -> pb.HandshakeResponse:
        if self.d.handshakes.slots.locked():
            raise ResourceExhausted(f"more than {self.d.config.max_pending_handshakes} handshakes pending")
        async with self.d.handshakes.slots:
            callee = self.d.handshakes.handshake(introduction_from_pb(request.caller))
            return pb.HandshakeResponse(callee=engine_to_pb(callee), data_token=callee.data_token)

    @rpc
    def Abort(self, request: pb.PeerAbortRequest, context: Any) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.d.publisher.peer_abort(peer_abort_from_pb(request)))

    @rpc
    async def Digest(self, request: pb.DigestRequest, context: Any) -> pb.DigestResponse:
        query = digest_query_from_pb(request)
        self.d.registry.check_peer_engine(query.engine_id)
        return digest_answer_to_pb(await self.d.verifier.answer(query), query)

    @rpc
    def RenewLeases(self, request: pb.RenewLeasesRequest, context: Any) -> pb.RenewLeasesResponse:
        return pb.RenewLeasesResponse(alive=self.d.publisher.renew_leases(request.engine_id, leases_from_pb(request)))

    @rpc
    async def Resolve(self, request: pb.ResolveRequest, context: Any) -> pb.ResolveResponse:
        r = request
        return resolution_to_pb(await self.d.publisher.resolve(r.engine_id, r.request_id, r.capability, r.wait_seconds))

    @rpc
    def ReportFinished(self, request: pb.ReportFinishedRequest, context: Any) -> pb.ReportFinishedResponse:
        self.d.finished.reports.receive(report_from_pb(request), self.d.finished.report_to_hub)
        return pb.ReportFinishedResponse()


class AdminService(pbg.AdminServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    @rpc
    def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        return status_to_pb(self.d)


def status_to_pb(d: Daemon) -> pb.StatusResponse:
    now = time.monotonic()
    return pb.StatusResponse(
        engine_id=d.config.engine_id, epoch=d.epoch, version=__version__, draining=d.draining,
        workers=[pb.WorkerStatus(worker=worker_to_pb(r.worker), regions=len(r.regions), bytes=r.nbytes, layers=sum(len(g.layers) for g in r.groups), region_ids=sorted(r.regions)) for r in d.registry],
        peers=sorted(d.handshakes.peers), publications=len(d.publications), pinned_ranks=d.publications.pinned, pulls_in_flight=len(d.puller.pulls),
        leases=[pb.LeaseStatus(request_id=p.request_id, generation=p.generation, ranks=[f"tp{t}/pp{q}" for t, q in sorted(p.masks)], expires_in_seconds=p.expires_at - now)
                for p in list(d.publications.by_request.values())[:200]],
        pulls=[pb.PullStatus(request_id=rid, worker=str(p.worker), remote_engine_id=p.params.remote_engine_id, age_seconds=now - p.started,
                             phase=p.progress.phase, landed_bytes=landed, planned_bytes=planned)
               for (_, rid), p in list(d.puller.pulls.items())[:200] for landed, planned in [p.progress.landed_bytes()]],
        recent_failures=[pb.FailureStatus(request_id=f.request_id, reason=f.reason, message=f.message, age_seconds=now - f.at) for f in d.puller.recent_failures],
        staging_buffers=d.data_client.staging_buffers(), staging_bytes=d.data_client.staging_bytes(),
        tasks=len(d.tasks) + len(d.puller.pulls),
        queues=[pb.QueueStatus(priority=q.priority, tenant=q.tenant, waiting=q.waiting, moving=q.moving, granted_bytes=q.granted_bytes, side=side)
                for side, q in ([("send", q) for q in d.wire_gate.queues()] + d.data_client.admission_queues() if d.wire_gate is not None else [])],
    )


def build_server(daemon: Daemon) -> tuple[grpc.aio.Server, health.HealthServicer]:
    interceptors = [TokenInterceptor(daemon.auth.token)] if daemon.auth.mode == "token" else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.so_reuseport", 0),
    ])
    register_service(server, WorkerService(daemon), "Worker")
    register_service(server, PeerService(daemon), "Peer")
    register_service(server, AdminService(daemon), "Admin")
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
