"""What the daemon starts toward others: calls to peer daemons, in the core's
terms (the one place on that side where they become protobuf), over one gRPC
channel a peer; and the background tasks its calls leave running (aborts,
renewals). A refused call raises ``grpc.aio.AioRpcError``, as gRPC does."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import grpc

from kvd.auth import AuthConfig
from kvd.convert import (
    digest_answer_from_pb,
    digest_query_to_pb,
    engine_to_pb,
    introduction_from_pb,
    peer_abort_to_pb,
    renew_to_pb,
    report_to_pb,
    resolution_from_pb,
)
from kvd.core.digest import DigestAnswer, DigestQuery
from kvd.core.requests import FinishedReport, Introduction, LeaseRef, PeerAbort, Resolution
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg


class PeerChannels:
    """Peer daemons' ``Peer`` service, one gRPC channel an address, with this daemon's credentials."""

    def __init__(self, auth: AuthConfig) -> None:
        self._auth = auth
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self._auth.aio_channel(address)
        return ch

    def _stub(self, address: str) -> pbg.PeerStub:
        return pbg.PeerStub(self.channel(address))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to a peer carries (the shared token, where configured)."""
        return tuple(self._auth.call_metadata())

    async def handshake(self, address: str, mine: Introduction, timeout: float) -> Introduction:
        resp = await self._stub(address).Handshake(pb.HandshakeRequest(caller=engine_to_pb(mine)), timeout=timeout,
                                                   metadata=self.metadata())
        if any(r.regions for r in resp.callee.ranks):  # a same-host peer's tensor views: many, checked off the loop
            return await asyncio.to_thread(introduction_from_pb, resp.callee, resp.data_token)
        return introduction_from_pb(resp.callee, resp.data_token)

    async def resolve(self, address: str, engine_id: str, request_id: str, capability: bytes, wait_seconds: float,
                      timeout: float) -> Resolution:
        resp = await self._stub(address).Resolve(
            pb.ResolveRequest(engine_id=engine_id, request_id=request_id, capability=capability, wait_seconds=wait_seconds),
            timeout=timeout, metadata=self.metadata())
        return resolution_from_pb(resp)

    async def abort(self, address: str, abort: PeerAbort, timeout: float) -> bool:
        resp = await self._stub(address).Abort(peer_abort_to_pb(abort), timeout=timeout, metadata=self.metadata())
        return bool(resp.found)

    async def renew(self, address: str, engine_id: str, reader_engine_id: str, leases: list[LeaseRef], timeout: float) -> list[bool]:
        resp = await self._stub(address).RenewLeases(renew_to_pb(engine_id, reader_engine_id, leases), timeout=timeout,
                                                     metadata=self.metadata())
        return list(resp.alive)

    async def report(self, address: str, report: FinishedReport, timeout: float) -> None:
        await self._stub(address).ReportFinished(report_to_pb(report), timeout=timeout, metadata=self.metadata())

    async def digest(self, address: str, query: DigestQuery, timeout: float) -> DigestAnswer:
        resp = await self._stub(address).Digest(digest_query_to_pb(query), timeout=timeout, metadata=self.metadata())
        return digest_answer_from_pb(resp, query)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class Tasks:
    """Fire-and-forget work, held so the loop does not drop it half done."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __len__(self) -> int:
        return len(self._tasks)
