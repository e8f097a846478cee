"""The gRPC shell: translate RPCs into Daemon calls and KvdErrors into statuses."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvd.aggregate import WorkerFinished
from kvd.convert import worker_from_pb
from kvd.daemon.daemon import Daemon
from kvd.errors import KvdError
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg

log = logging.getLogger("kvd.service")
T = TypeVar("T")

# Control messages are small; a registration of thousands of layers is < 1 MiB.
MAX_MESSAGE_BYTES = 16 << 20


def rpc(fn: Callable[..., T]) -> Callable[..., Awaitable[T]]:
    """Run a handler; a KvdError becomes its gRPC status with its message."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            result = fn(self, request, context)
            if hasattr(result, "__await__"):
                result = await result  # type: ignore[misc]
            return result
        except KvdError as e:
            await context.abort(e.code, e.message)
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable")

    return wrapper


def finished_to_pb(f: WorkerFinished) -> pb.GetFinishedResponse:
    details = [
        pb.FinishedDetail(request_id=o.request_id, direction=o.direction, outcome=o.outcome, reason=o.reason, bytes=o.bytes)
        for o in (*f.sending.values(), *f.recving.values())
    ]
    return pb.GetFinishedResponse(
        finished_sending=sorted(f.sending), finished_recving=sorted(f.recving),
        invalid_block_ids=sorted(f.invalid_block_ids), details=details,
    )


class WorkerService(pbg.WorkerServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    @rpc
    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        return self.d.register(request)

    @rpc
    def Unregister(self, request: pb.UnregisterRequest, context: Any) -> pb.UnregisterResponse:
        self.d.unregister(worker_from_pb(request.worker))
        return pb.UnregisterResponse()

    @rpc
    def Publish(self, request: pb.PublishRequest, context: Any) -> pb.PublishResponse:
        return self.d.publish(request)

    @rpc
    def Pull(self, request: pb.PullRequest, context: Any) -> pb.PullResponse:
        return self.d.pull(request)

    @rpc
    def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.d.abort(request))

    @rpc
    def GetFinished(self, request: pb.GetFinishedRequest, context: Any) -> pb.GetFinishedResponse:
        return finished_to_pb(self.d.get_finished(worker_from_pb(request.worker)))

    @rpc
    def GetEngineFinished(self, request: pb.EngineFinishedRequest, context: Any) -> pb.GetFinishedResponse:
        return finished_to_pb(self.d.engine_finished(request.engine_id))

    async def WatchEngineFinished(self, request: pb.EngineFinishedRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetFinishedResponse]:
        """Push the engine's merged sets as requests complete; nobody polls."""
        try:
            self.d._check_engine(request.engine_id)
        except KvdError as e:
            await context.abort(e.code, e.message)
        queue: asyncio.Queue[WorkerFinished] = asyncio.Queue()
        self.d.engine_hub.subscribers.append(queue.put_nowait)
        try:
            backlog = self.d.engine_hub.drain()
            if backlog.sending or backlog.recving or backlog.invalid_block_ids:
                yield finished_to_pb(backlog)
            while True:
                yield finished_to_pb(await queue.get())
        finally:
            self.d.engine_hub.subscribers.remove(queue.put_nowait)

    @rpc
    def SetExpectedFinishedCount(self, request: pb.SetExpectedFinishedCountRequest, context: Any) -> pb.SetExpectedFinishedCountResponse:
        return pb.SetExpectedFinishedCountResponse(expected_finished_count=self.d.set_expected_finished_count(request.engine_id, request.expected_finished_count))


class PeerService(pbg.PeerServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    @rpc
    def Handshake(self, request: pb.HandshakeRequest, context: Any) -> pb.HandshakeResponse:
        return self.d.handshake(request)

    @rpc
    def Abort(self, request: pb.PeerAbortRequest, context: Any) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.d.peer_abort(request))

    @rpc
    def RenewLeases(self, request: pb.RenewLeasesRequest, context: Any) -> pb.RenewLeasesResponse:
        return self.d.renew_leases(request)

    @rpc
    def ReportFinished(self, request: pb.ReportFinishedRequest, context: Any) -> pb.ReportFinishedResponse:
        self.d.report_finished(request)
        return pb.ReportFinishedResponse()


class AdminService(pbg.AdminServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    @rpc
    def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        return self.d.status()


def build_server(daemon: Daemon) -> tuple[grpc.aio.Server, health.HealthServicer]:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    pbg.add_WorkerServicer_to_server(WorkerService(daemon), server)
    pbg.add_PeerServicer_to_server(PeerService(daemon), server)
    pbg.add_AdminServicer_to_server(AdminService(daemon), server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
