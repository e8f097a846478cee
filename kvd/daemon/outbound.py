"""What the daemon starts toward others: gRPC channels to peer daemons, and
the background tasks its calls leave running (aborts, renewals)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import grpc

from kvd.auth import AuthConfig
from kvd.proto import kvd_pb2_grpc as pbg


class PeerChannels:
    """One gRPC channel a peer address, with this daemon's credentials."""

    def __init__(self, auth: AuthConfig) -> None:
        self._auth = auth
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self._auth.aio_channel(address)
        return ch

    def peer(self, address: str) -> pbg.PeerStub:
        return pbg.PeerStub(self.channel(address))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to a peer carries (the shared token, where configured)."""
        return tuple(self._auth.call_metadata())

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
