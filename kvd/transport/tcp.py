"""The TCP data plane: uvloop sockets, zero-copy on both ends.

Owner side: each DATA payload is sent straight from registered memory when the
requested view is contiguous there, else from a per-connection staging
buffer. Reader side: each payload is received straight into the destination
when it already has the wire layout, else into one of two staging buffers
whose relayout runs in a worker thread while the next segment arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence

import torch

from kvd import errors
from kvd.proto import kvd_pb2 as pb
from kvd.transfer import SegmentSink
from kvd.transport.base import ReadServer, Staging
from kvd.wire import (
    HEADER_SIZE,
    Connection,
    FrameType,
    Header,
    ProtocolError,
    decode_header,
    encode,
)

log = logging.getLogger("kvd.tcp")

# Below this a segment is relaid out on the event loop: waking a worker thread
# and the loop again costs ~100 us, more than copying 1 MiB at memcpy speed.
INLINE_LAND_BYTES = 1 << 20


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, conn: Connection) -> tuple[FrameType, int, int]:
    raw = bytearray(HEADER_SIZE)
    await _recv_exactly(loop, sock, memoryview(raw))
    header = conn.receive(decode_header(raw))
    return header.type, header.tag, header.length


async def _recv_body(loop: asyncio.AbstractEventLoop, sock: socket.socket, length: int) -> bytes:
    buf = bytearray(length)
    await _recv_exactly(loop, sock, memoryview(buf))
    return bytes(buf)


class TcpDataServer:
    """Serves reads of this daemon's registered memory."""

    def __init__(self, server: ReadServer, host: str, port: int, *, hello_timeout_s: float = 10.0) -> None:
        self.server = server
        self.host, self.port = host, port
        self.hello_timeout_s = hello_timeout_s
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accept = asyncio.create_task(self._accept_loop())
        return self.port

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn = Connection(server=True)
        staging = Staging()
        host_staging = Staging(pinned=True)
        try:
            _hello, _, length = await asyncio.wait_for(_recv_frame(loop, sock, conn), self.hello_timeout_s)
            hello = pb.DataHello.FromString(await _recv_body(loop, sock, length))
            try:
                self.server.check_hello(hello)
            except errors.KvdError as e:
                await loop.sock_sendall(sock, encode(FrameType.ERROR, pb.DataError(code=e.code.name, message=e.message).SerializeToString()))
                return
            await loop.sock_sendall(sock, encode(FrameType.HELLO_OK))
            conn.sent(FrameType.HELLO_OK)
            while True:
                _read, _, length = await _recv_frame(loop, sock, conn)  # the state machine only admits READ here
                read = pb.DataRead.FromString(await _recv_body(loop, sock, length))
                try:
                    opened = self.server.open_read(hello, read)
                except errors.KvdError as e:
                    await loop.sock_sendall(sock, encode(FrameType.ERROR, pb.DataError(code=e.code.name, message=e.message).SerializeToString()))
                    conn.sent(FrameType.ERROR)
                    continue
                total = 0
                failed: errors.KvdError | None = None
                for i in range(len(read.segments)):
                    try:
                        opened.check_alive()
                    except errors.KvdError as e:
                        failed = e
                        break
                    payload = opened.segment(i, staging)
                    if payload.device.type != "cpu":
                        # GPU memory leaves through pinned host staging.
                        payload = host_staging(payload.numel()).copy_(payload)
                    await loop.sock_sendall(sock, Header(FrameType.DATA, i, payload.numel()).encode())
                    await loop.sock_sendall(sock, _as_bytes(payload))
                    total += payload.numel()
                if failed is not None:
                    await loop.sock_sendall(sock, encode(FrameType.ERROR, pb.DataError(code=failed.code.name, message=failed.message).SerializeToString()))
                    conn.sent(FrameType.ERROR)
                    continue
                await loop.sock_sendall(sock, encode(FrameType.END, pb.DataEnd(bytes=total).SerializeToString()))
                conn.sent(FrameType.END)
                _ack, _, length = await _recv_frame(loop, sock, conn)
                await _recv_body(loop, sock, length)
                opened.acknowledged()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        except (TimeoutError, ProtocolError) as e:
            log.warning("data-plane connection closed: %s", e)
        except Exception:
            log.exception("data-plane connection failed")
        finally:
            sock.close()

    async def close(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.proto = Connection(server=False)
        self.staging = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]


class TcpDataClient:
    """Reads from peers' data planes over a small pool of connections each."""

    name = "tcp"

    def __init__(self, hello: pb.DataHello, *, connections_per_peer: int = 4, stall_timeout_s: float = 30.0) -> None:
        self.hello = hello
        self.connections_per_peer = connections_per_peer
        self.stall_timeout_s = stall_timeout_s
        self._idle: dict[str, list[_Conn]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}

    async def _connect(self, address: str) -> _Conn:
        loop = asyncio.get_running_loop()
        host, port = _split(address)
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, stype, proto, _, addr = infos[0]
        sock = socket.socket(family, stype, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, addr), self.stall_timeout_s)
            conn = _Conn(sock)
            await loop.sock_sendall(sock, encode(FrameType.HELLO, self.hello.SerializeToString()))
            conn.proto.sent(FrameType.HELLO)
            ftype, _, length = await asyncio.wait_for(_recv_frame(loop, sock, conn.proto), self.stall_timeout_s)
            if ftype is FrameType.ERROR:
                err = pb.DataError.FromString(await _recv_body(loop, sock, length))
                raise errors.from_code(err.code, err.message)
        except BaseException:
            sock.close()
            raise
        return conn

    async def read(self, address: str, read: pb.DataRead, sinks: Sequence[SegmentSink], landed: list[bool]) -> int:
        slots = self._slots.setdefault(address, asyncio.Semaphore(self.connections_per_peer))
        async with slots:
            idle = self._idle.setdefault(address, [])
            conn = idle.pop() if idle else await self._connect(address)
            try:
                moved = await self._read_on(conn, read, sinks, landed)
            except BaseException:
                conn.sock.close()
                raise
            idle.append(conn)
            return moved

    async def _read_on(self, conn: _Conn, read: pb.DataRead, sinks: Sequence[SegmentSink], landed: list[bool]) -> int:
        loop = asyncio.get_running_loop()
        sock = conn.sock
        await loop.sock_sendall(sock, encode(FrameType.READ, read.SerializeToString()))
        conn.proto.sent(FrameType.READ, segments=len(sinks))
        pending: list[asyncio.Future[None] | None] = [None, None]
        moved = 0
        timeout = self.stall_timeout_s
        try:
            while True:
                async with asyncio.timeout(timeout):
                    ftype, tag, length = await _recv_frame(loop, sock, conn.proto)
                if ftype is FrameType.ERROR:
                    err = pb.DataError.FromString(await _recv_body(loop, sock, length))
                    raise errors.from_code(err.code, err.message)
                if ftype is FrameType.END:
                    await _recv_body(loop, sock, length)
                    break
                sink = sinks[tag]
                if length != sink.nbytes:
                    raise ProtocolError(f"segment {tag} carries {length} bytes, expected {sink.nbytes}")
                direct = sink.direct()
                if direct is not None and direct.device.type == "cpu":
                    async with asyncio.timeout(timeout):
                        await _recv_exactly(loop, sock, _as_bytes(direct))
                    landed[tag] = True
                else:
                    slot = tag % 2
                    prev = pending[slot]
                    if prev is not None:
                        await prev  # the buffer is free again once its relayout is done
                        pending[slot] = None
                    if conn.staging[slot].numel() < length:
                        conn.staging[slot] = torch.empty(length, dtype=torch.uint8)
                    buf = conn.staging[slot][:length]
                    async with asyncio.timeout(timeout):
                        await _recv_exactly(loop, sock, _as_bytes(buf))
                    if length < INLINE_LAND_BYTES:
                        # A thread handoff costs more than copying this little.
                        _land(sink, buf, landed, tag)
                    else:
                        pending[slot] = loop.run_in_executor(None, _land, sink, buf, landed, tag)
                moved += length
            for fut in pending:
                if fut is not None:
                    await fut
        finally:
            for fut in pending:
                if fut is not None and not fut.done():
                    with contextlib.suppress(BaseException):
                        await fut
        await loop.sock_sendall(sock, encode(FrameType.ACK))
        conn.proto.sent(FrameType.ACK)
        return moved

    def staging_buffers(self) -> int:
        return sum(1 for conns in self._idle.values() for c in conns for b in c.staging if b.numel())

    def staging_bytes(self) -> int:
        return sum(b.numel() for conns in self._idle.values() for c in conns for b in c.staging)

    async def forget(self, address: str) -> None:
        """Drop pooled connections to ``address`` (its daemon may have restarted)."""
        for c in self._idle.pop(address, []):
            c.sock.close()

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.sock.close()
        self._idle.clear()


def _land(sink: SegmentSink, buf: torch.Tensor, landed: list[bool], tag: int) -> None:
    sink.land(buf)
    landed[tag] = True
