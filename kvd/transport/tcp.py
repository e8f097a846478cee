"""The TCP data plane: zero-copy on both ends.

Owner side: a DATA frame leaves straight from registered memory, one
sendmsg over the segment's pieces (a contiguous run, or one piece per block
for scattered blocks: ``kvd.transport.iovec``), or from a per-connection
staging buffer when those bytes are not dense pieces there (a head slice of an
interleaved layout). GPU memory is gathered on the GPU and copied to pinned
memory on a side stream while the previous segment is sent
(``kvd.transport.device``).

Reader side: a frame is received straight into place (recvmsg with
MSG_WAITALL into the pieces) when local memory has the wire layout, else into
one of two (pinned) staging buffers whose relayout runs in another thread,
on the GPU for GPU caches, while the next frame arrives.

Bulk I/O runs in worker threads on blocking sockets, with SO_RCVTIMEO and
SO_SNDTIMEO bounding a stall; the event loop accepts, authorises and takes
the ACK. The END and the ACK are sent by the threads that moved the bytes, so
no hop back to the loop sits on a read's critical path. A small read (at most
``inline_send_bytes``, all in place) is the exception on the owner side: its
whole answer leaves from the loop in one non-blocking sendmsg, and only what
the socket buffer does not take goes to a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvd.convert import read_from_pb, read_to_pb
from kvd.core import errors
from kvd.core.reads import DataRead
from kvd.core.transfer import SegmentSink
from kvd.core.wire import (
    FLAG_LOCAL,
    FLAG_NIXL,
    HEADER_SIZE,
    Connection,
    FrameType,
    Header,
    ProtocolError,
    decode_header,
    encode,
)
from kvd.proto import kvd_pb2 as pb
from kvd.transport import iovec
from kvd.transport.base import ReadServer, Staging
from kvd.transport.device import DeviceToHost, device_copies
from kvd.transport.nixl import Arena, NixlAgent, expose, land
from kvd.transport.samehost import LocalSource, copy_local

log = logging.getLogger("kvd.tcp")

# Bigger kernel buffers let one recv_into/send return megabytes, so the event
# loop wakes far less often per byte (the per-wakeup cost is what limits us).
SOCKET_BUFFER_BYTES = 8 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)



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


async def _recv_raw_header(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytearray:
    raw = bytearray(HEADER_SIZE)
    await _recv_exactly(loop, sock, memoryview(raw))
    return raw


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, conn: Connection) -> tuple[FrameType, int, int]:
    header = conn.receive(decode_header(await _recv_raw_header(loop, sock)))
    return header.type, header.tag, header.length


async def _recv_body(loop: asyncio.AbstractEventLoop, sock: socket.socket, length: int) -> bytes:
    buf = bytearray(length)
    await _recv_exactly(loop, sock, memoryview(buf))
    return bytes(buf)


class TcpDataServer:
    """Serves reads of this daemon's registered memory."""

    def __init__(self, server: ReadServer, host: str, port: int, *, hello_timeout_s: float = 10.0,
                 max_connections_per_peer: int = 16, max_connections: int = 256, tls: ssl.SSLContext | None = None,
                 nixl: NixlAgent | None = None, nixl_staging_bytes: int = 1 << 30, inline_send_bytes: int = 4 << 20,
                 pinned_read_timeout_s: float = 60.0) -> None:
        self.server = server
        # A read this small is written from the event loop without blocking
        # (the rest, if the socket buffer fills, from a thread): a thread hop
        # costs more than the copy into the socket buffer.
        self.inline_send_bytes = inline_send_bytes
        self.tls = tls  # mTLS: every connection is served in a thread over TLS
        self.nixl = nixl  # transport nixl: reads may ask for descriptors instead of DATA
        self.nixl_staging_bytes = nixl_staging_bytes
        self.host, self.port = host, port
        self.hello_timeout_s = hello_timeout_s
        # How long a reader that copies our memory itself (same host, NIXL)
        # may keep its rank pinned before it ACKs: a local copy or a NIXL
        # READ of one read takes seconds at most; past this the reader is
        # taken as hung and the connection closed.
        self.pinned_read_timeout_s = pinned_read_timeout_s
        # Each connection holds at most one segment of staging, and a slow
        # reader only blocks its own sends; capping connections caps memory.
        self.max_connections_per_peer = max_connections_per_peer
        self.max_connections = max_connections
        self._per_peer: dict[str, int] = {}
        # Bulk sends run in threads on blocking sockets: one sendmsg per
        # segment and no event-loop wakeup per chunk (that wakeup, not the
        # copy, is what bounded the asyncio path).
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvd-send")
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
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:  # EMFILE, ECONNABORTED...: keep serving the others
                log.warning("data-plane accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            _tune(conn)
            if len(self._conns) >= self.max_connections:
                conn.close()  # over the overall cap: refuse before reading a byte
                continue
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        if self.tls is not None:
            # A TLS connection lives in its own thread for its whole life (pooled
            # threads would run out with idle reader connections).
            done = loop.create_future()

            def run() -> None:
                try:
                    self._serve_tls(sock, loop)
                finally:
                    loop.call_soon_threadsafe(_resolve, done)

            threading.Thread(target=run, name="kvd-tls", daemon=True).start()
            await done
            return
        conn = Connection(server=True)
        peer_key = ""
        staging = Staging()
        to_host = DeviceToHost()
        arena = Arena(self.nixl) if self.nixl is not None else None
        try:
            async with asyncio.timeout(self.hello_timeout_s):  # the whole HELLO, body included
                _hello, _, length = await _recv_frame(loop, sock, conn)
                hello = pb.DataHello.FromString(await _recv_body(loop, sock, length))
            try:
                self.server.check_hello(hello)
                self._take_slot(hello.engine_id)
                peer_key = hello.engine_id
            except errors.KvdError as e:
                peer_key = ""
                await loop.sock_sendall(sock, encode(FrameType.ERROR, pb.DataError(code=e.code.name, message=e.message).SerializeToString()))
                return
            await loop.sock_sendall(sock, encode(FrameType.HELLO_OK))
            conn.sent(FrameType.HELLO_OK)
            while True:
                header = conn.receive(decode_header(await _recv_raw_header(loop, sock)))  # only READ is admitted here
                read = read_from_pb(pb.DataRead.FromString(await _recv_body(loop, sock, header.length)))
                local, nixl = bool(header.flags & FLAG_LOCAL), bool(header.flags & FLAG_NIXL)
                try:
                    opened = self.server.open_read(hello, read, local=local, reader_copies=nixl)
                except errors.KvdError as e:
                    await loop.sock_sendall(sock, encode(FrameType.ERROR, pb.DataError(code=e.code.name, message=e.message).SerializeToString()))
                    conn.sent(FrameType.ERROR)
                    continue
                try:
                    if local:  # a same-host read: the reader copies, we only authorise
                        await loop.sock_sendall(sock, encode(FrameType.END, pb.DataEnd(bytes=0).SerializeToString()))
                        conn.sent(FrameType.END)
                    elif nixl or (whole := self._small_answer(opened, len(read.segments))) is None:
                        if not await loop.run_in_executor(self._pool, self._answer, sock, conn, opened, read, header.flags, staging, to_host, arena):
                            continue
                    elif not await self._send_small(loop, sock, conn, opened, *whole):
                        continue
                    # A reader that copies our memory itself holds its pin until
                    # this ACK; one that never sends it may not hold it forever.
                    async with asyncio.timeout(self.pinned_read_timeout_s if opened.pin is not None else None):
                        _ack, _, length = await _recv_frame(loop, sock, conn)
                        await _recv_body(loop, sock, length)
                    opened.acknowledged()
                finally:
                    opened.close()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        except (TimeoutError, ProtocolError) as e:
            log.warning("data-plane connection closed: %s", e)
        except Exception:
            log.exception("data-plane connection failed")
        finally:
            if peer_key:
                self._release_slot(peer_key)
            sock.close()
            if arena is not None:
                arena.release()

    def _answer(self, sock: socket.socket, conn: Connection, opened: Any, read: DataRead, flags: int, staging: Staging,
                to_host: DeviceToHost, arena: Arena | None) -> bool:
        """Owner side of one authorised read, in a worker thread: the DATA (or
        DESCS) frames, then END or ERROR from this same thread, so the reader
        is not kept waiting on a hop back to the event loop. True after END
        (the reader's ACK follows)."""
        with _blocking(sock, self.hello_timeout_s * 3):
            failed: errors.KvdError | None
            if flags & FLAG_LOCAL:
                failed, total = None, 0
            elif flags & FLAG_NIXL:
                failed, total = self._send_descriptors(sock, opened, len(read.segments), arena, read.nixl_metadata_version)
            else:
                failed, total = _send_segments(sock, opened, len(read.segments), staging, to_host)
                if failed is None:
                    # Every byte left while the publication was alive: only
                    # then END, as the engine may reuse the blocks once it ends.
                    try:
                        opened.check_alive()
                    except errors.KvdError as e:
                        failed = e
            if failed is not None:
                sock.sendall(encode(FrameType.ERROR, pb.DataError(code=failed.code.name, message=failed.message).SerializeToString()))
                conn.sent(FrameType.ERROR)
                return False
            sock.sendall(encode(FrameType.END, pb.DataEnd(bytes=total).SerializeToString()))
            conn.sent(FrameType.END)
            return True

    async def _send_small(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, conn: Connection, opened: Any,
                          iov: np.ndarray, keep: list[np.ndarray], total: int, blocks: int) -> bool:
        """A small read's answer: every DATA frame and the END in one
        non-blocking sendmsg, authorised in this same loop step. If the
        socket buffer fills, the rest of the data goes from a thread, and the
        END only once the publication is seen alive after its last byte left
        (else ERROR). ``keep`` holds the buffers ``iov`` points into until
        then. True after END."""
        end = encode(FrameType.END, pb.DataEnd(bytes=total).SerializeToString())
        data = iovec.nbytes(iov) - len(end)
        sent = iovec.send_nowait(sock, iov)
        if sent < data:
            await loop.run_in_executor(self._pool, self._send_rest, sock, iovec.advance(iovec.head(iov, data), sent))
            try:
                opened.check_alive()
            except errors.KvdError as e:
                await loop.sock_sendall(sock, encode(FrameType.ERROR, pb.DataError(code=e.code.name, message=e.message).SerializeToString()))
                conn.sent(FrameType.ERROR)
                return False
        if sent < data + len(end):
            await loop.sock_sendall(sock, end[max(0, sent - data):])
        opened.count_sent(total, blocks, "tcp")
        conn.sent(FrameType.END)
        return True

    def _small_answer(self, opened: Any, count: int) -> tuple[np.ndarray, list[np.ndarray], int, int] | None:
        """A small read's whole answer (every DATA frame, then END) as one
        iovec list over registered host memory, the buffers it points into
        besides, its payload bytes and its blocks; None where it is not small
        or some segment must be gathered."""
        total = 0
        for i in range(count):
            total += opened.segment_nbytes(i)
            if total > self.inline_send_bytes:
                return None
        parts: list[bytes | np.ndarray] = []
        for i in range(count):
            iov = opened.segment_iov(i)
            if iov is None:
                return None
            parts += [Header(FrameType.DATA, i, iovec.nbytes(iov)).encode(), iov]
        parts.append(encode(FrameType.END, pb.DataEnd(bytes=total).SerializeToString()))
        iov, keep = iovec.chain(parts)
        return iov, keep, total, sum(opened.segment_blocks(i) for i in range(count))

    def _send_rest(self, sock: socket.socket, iov: np.ndarray) -> None:
        with _blocking(sock, self.hello_timeout_s * 3):
            iovec.send_all(sock, iov)

    def _send_descriptors(self, sock: socket.socket, opened: Any, count: int, arena: Arena | None,
                          reader_version: int) -> tuple[errors.KvdError | None, int]:
        """Owner side of a NIXL read: one DESCS frame."""
        if self.tls is not None:
            return errors.FailedPrecondition("transport nixl is not offered over an mTLS data plane (NIXL traffic is not encrypted)"), 0
        if self.nixl is None or arena is None:
            return errors.FailedPrecondition("this daemon's data plane has no NIXL agent (set transport: nixl on both sides)"), 0
        try:
            msg, total = expose(self.nixl, opened, count, arena, self.nixl_staging_bytes)
        except errors.KvdError as e:
            return e, 0
        metadata, version = self.nixl.metadata()
        msg.metadata_version = version
        if reader_version != version:  # the reader's copy lacks some registration (or it has none)
            msg.agent_metadata = metadata
        sock.sendall(encode(FrameType.DESCS, msg.SerializeToString()))
        return None, total

    def _serve_tls(self, raw: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """One TLS connection, in a worker thread; daemon calls hop to the loop."""
        raw.setblocking(True)
        raw.settimeout(self.hello_timeout_s)
        assert self.tls is not None
        try:
            sock = self.tls.wrap_socket(raw, server_side=True)  # no or wrong certificate: fails here
        except (ssl.SSLError, OSError) as e:
            log.info("data-plane TLS handshake refused: %s", e)
            raw.close()
            return
        conn = Connection(server=True)
        peer_key = ""
        staging, to_host = Staging(), DeviceToHost()
        try:
            header, body = _read_frame_blocking(sock, conn)
            hello = pb.DataHello.FromString(body)
            try:
                _on_loop(loop, self.server.check_hello, hello)
                _on_loop(loop, self._take_slot, hello.engine_id)
                peer_key = hello.engine_id
            except errors.KvdError as e:
                sock.sendall(encode(FrameType.ERROR, pb.DataError(code=e.code.name, message=e.message).SerializeToString()))
                return
            sock.sendall(encode(FrameType.HELLO_OK))
            conn.sent(FrameType.HELLO_OK)
            while True:
                sock.settimeout(None)  # idle between reads
                header, body = _read_frame_blocking(sock, conn)
                read = read_from_pb(pb.DataRead.FromString(body))
                local = bool(header.flags & FLAG_LOCAL)
                try:
                    opened = _on_loop(loop, functools.partial(self.server.open_read, hello, read, local=local))
                except errors.KvdError as e:
                    sock.sendall(encode(FrameType.ERROR, pb.DataError(code=e.code.name, message=e.message).SerializeToString()))
                    conn.sent(FrameType.ERROR)
                    continue
                try:
                    if not self._answer(sock, conn, opened, read, header.flags, staging, to_host, None):
                        continue
                    sock.settimeout(self.pinned_read_timeout_s if opened.pin is not None else None)
                    _read_frame_blocking(sock, conn)
                    _on_loop(loop, opened.acknowledged)
                finally:
                    loop.call_soon_threadsafe(opened.close)
        except (ConnectionError, OSError, ProtocolError) as e:
            if not isinstance(e, ConnectionError):
                log.info("data-plane TLS connection closed: %s", e)
        except Exception:
            log.exception("data-plane TLS connection failed")
        finally:
            if peer_key:
                loop.call_soon_threadsafe(self._release_slot, peer_key)
            sock.close()

    def _take_slot(self, engine_id: str) -> None:
        """Per-reader connection accounting, always on the loop."""
        if self._per_peer.get(engine_id, 0) >= self.max_connections_per_peer:
            raise errors.ResourceExhausted(f"engine {engine_id!r} already has {self.max_connections_per_peer} data connections")
        self._per_peer[engine_id] = self._per_peer.get(engine_id, 0) + 1

    def _release_slot(self, engine_id: str) -> None:
        if self._per_peer.get(engine_id, 0) > 0:
            self._per_peer[engine_id] -= 1

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
        self._pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def _blocking(sock: socket.socket, timeout: float) -> Iterator[socket.socket]:
    """Lend a loop socket to a worker thread; the timeout is the stall bound.

    A plain socket goes fully blocking with SO_RCVTIMEO/SO_SNDTIMEO as the
    bound: Python's own timeout would poll() before every syscall, and the
    vectorised iovec calls need a blocking descriptor anyway."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(timeout)
    else:
        sock.setblocking(True)
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    try:
        yield sock
    finally:
        if not isinstance(sock, ssl.SSLSocket):  # a TLS socket stays with its thread
            sock.setblocking(False)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a daemon method on its event loop from a worker thread (daemon state
    is only ever touched there) and return its result or raise its error."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)

    loop.call_soon_threadsafe(run)
    return done.result()


def _read_frame_blocking(sock: socket.socket, conn: Connection) -> tuple[Header, bytes]:
    raw = bytearray(HEADER_SIZE)
    _recv_into_all(sock, memoryview(raw))
    header = conn.receive(decode_header(raw))
    body = bytearray(header.length)
    _recv_into_all(sock, memoryview(body))
    return header, bytes(body)


def _sendmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS
        for b in buffers:
            sock.sendall(b)
        return
    while buffers:
        sent = sock.sendmsg(buffers)
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if buffers and sent:
            buffers[0] = buffers[0][sent:]


def _send_segments(sock: socket.socket, opened: Any, count: int, staging: Staging, to_host: DeviceToHost) -> tuple[errors.KvdError | None, int]:
    """Owner side, on a blocking socket: every DATA frame of one read. Host
    memory leaves in place (one sendmsg over its pieces); the rest is gathered
    into staging first. A GPU segment is gathered and copied down while the
    segment before it is on the wire (``DeviceToHost``)."""
    total = 0
    plain = not isinstance(sock, ssl.SSLSocket)  # no sendmsg over TLS

    def start_on_device(i: int) -> bool:
        device = opened.segment_device(i)
        if device.type == "cpu":
            return False
        to_host.start(i, device, functools.partial(opened.segment, i))
        return True

    try:
        for i in range(count):
            try:
                opened.check_alive()
            except errors.KvdError as e:
                return e, total
            iov = opened.segment_iov(i) if plain else None
            if iov is not None:
                n = iovec.nbytes(iov)
                iovec.send_all(sock, iov, Header(FrameType.DATA, i, n).encode())
                opened.count_sent(n, opened.segment_blocks(i), "tcp")
                total += n
                continue
            if start_on_device(i):
                if i + 1 < count:
                    start_on_device(i + 1)  # its copy runs while this one is sent
                payload = to_host.take(i)
            else:
                payload = opened.segment(i, staging)
            _sendmsg_all(sock, [memoryview(Header(FrameType.DATA, i, payload.numel()).encode()), _as_bytes(payload)])
            total += payload.numel()
        return None, total
    finally:
        to_host.drain()


def _recv_into_all(sock: socket.socket, view: memoryview) -> None:
    got = 0
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < len(view):
        try:
            k = sock.recv_into(view[got:], 0, flags)
        except BlockingIOError as e:  # SO_RCVTIMEO ran out on a blocking socket
            raise TimeoutError("data-plane receive stalled") from e
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k


class _Landing:
    """Relayout off the receiving thread, so that segment k is relaid out
    while segment k+1 arrives: two staging buffers, at most one landing in
    flight. ``wait`` before reporting anything, so no byte lands after a
    failure is reported."""

    def __init__(self, pool: concurrent.futures.Executor, buffers: tuple[Staging, Staging], landed: list[bool],
                 on_relayout: Callable[[float], None], cancel: threading.Event) -> None:
        self.pool, self.buffers, self.landed = pool, buffers, landed
        self.on_relayout, self.cancel = on_relayout, cancel
        self.next = 0
        self.pending: concurrent.futures.Future[None] | None = None

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The buffer no landing is reading."""
        return self.buffers[self.next](nbytes)

    def submit(self, sink: SegmentSink, buf: torch.Tensor, tag: int) -> None:
        self.wait()  # the other buffer is free again
        self.pending = self.pool.submit(self._land, sink, buf, tag)
        self.next ^= 1

    def _land(self, sink: SegmentSink, buf: torch.Tensor, tag: int) -> None:
        if self.cancel.is_set():
            raise ConnectionAbortedError("read abandoned")
        t0 = time.perf_counter()
        with device_copies(sink.device):  # this thread's stream: beside other connections' landings
            sink.land(buf)
        self.on_relayout(time.perf_counter() - t0)
        self.landed[tag] = True

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def _recv_segments(sock: socket.socket, proto: Connection, sinks: Sequence[SegmentSink], landed: list[bool],
                   buffers: tuple[Staging, Staging], stall_s: float, on_relayout: Callable[[float], None],
                   cancel: threading.Event, land_pool: concurrent.futures.Executor) -> int:
    """Reader side, in a worker thread: DATA frames straight into place (or
    into staging, relaid out while the next frame arrives) until END or ERROR;
    then the ACK."""
    moved = 0
    raw = bytearray(HEADER_SIZE)
    plain = not isinstance(sock, ssl.SSLSocket)
    landing = _Landing(land_pool, buffers, landed, on_relayout, cancel)
    last: int | None = None  # the tag of the last DATA frame
    try:
        with _blocking(sock, stall_s):
            while True:
                if cancel.is_set():
                    raise ConnectionAbortedError("read abandoned")
                _recv_into_all(sock, memoryview(raw))
                header = proto.receive(decode_header(raw))
                if header.type is not FrameType.DATA:
                    body = bytearray(header.length)
                    _recv_into_all(sock, memoryview(body))
                    if header.type is FrameType.ERROR:
                        err = pb.DataError.FromString(bytes(body))
                        if last is not None:
                            # The owner saw the publication end after sending
                            # this segment: it may hold bytes of the blocks'
                            # reuse, so it counts as not landed (invalid).
                            landing.wait()
                            landed[last] = False
                        raise errors.from_code(err.code, err.message)
                    landing.wait()
                    # END: every byte landed. ACK from here, not after a hop back to the loop.
                    sock.sendall(encode(FrameType.ACK))
                    proto.sent(FrameType.ACK)
                    return moved
                sink = sinks[header.tag]
                last = header.tag
                if header.length != sink.nbytes:
                    raise ProtocolError(f"segment {header.tag} carries {header.length} bytes, expected {sink.nbytes}")
                iov = sink.iov() if plain else None
                if iov is not None:  # straight into place, scattered blocks included
                    iovec.recv_all(sock, iov)
                    landed[header.tag] = True
                else:
                    buf = landing.buffer(header.length)
                    _recv_into_all(sock, _as_bytes(buf))
                    landing.submit(sink, buf, header.tag)
                moved += header.length
    finally:
        with contextlib.suppress(BaseException):
            landing.wait()


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls = False
        # Set when the read is abandoned; worker threads check it before every
        # frame and every landing, so nothing lands after a failure is reported.
        self.cancel = threading.Event()
        self.work: asyncio.Future[Any] | None = None
        self.proto = Connection(server=False)
        # Received segments awaiting relayout (one lands while the other
        # fills); pinned where a GPU may take them, for full-speed uploads.
        self.staging = (Staging(pinned=True), Staging(pinned=True))
        self.arena: Arena | None = None  # NIXL landing scratch, registered on first use


class TcpDataClient:
    """Reads from peers' data planes over a small pool of connections each."""

    name = "tcp"

    def __init__(self, hello: pb.DataHello, *, connections_per_peer: int = 4, copy_threads: int = 2, stall_timeout_s: float = 30.0,
                 on_relayout: Callable[[float], None] = lambda seconds: None, tls: ssl.SSLContext | None = None,
                 nixl: NixlAgent | None = None) -> None:
        self.on_relayout = on_relayout
        self.nixl = nixl  # transport nixl: bulk bytes by NIXL READ, control on this connection
        self.tls = tls  # mTLS: connections are TLS and driven from worker threads
        self.hello = hello
        self.connections_per_peer = connections_per_peer
        self.stall_timeout_s = stall_timeout_s
        self._idle: dict[str, list[_Conn]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._tokens: dict[str, bytes] = {}
        self._nixl_peers: dict[str, tuple[str, int]] = {}  # data address -> (owner's NIXL agent, metadata version loaded)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="kvd-recv")
        self.copier = iovec.Copier(copy_threads)  # same-host reads
        # Relayout of received segments; each connection has at most one in flight.
        self._land_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvd-land")

    def _connect_tls(self, address: str, hello: pb.DataHello) -> _Conn:
        assert self.tls is not None
        host, port = _split(address)
        raw = socket.create_connection((host, port), timeout=self.stall_timeout_s)
        _tune(raw)
        try:
            sock = self.tls.wrap_socket(raw, server_hostname=host)
        except BaseException:
            raw.close()
            raise
        conn = _Conn(sock)
        conn.tls = True
        try:
            sock.sendall(encode(FrameType.HELLO, hello.SerializeToString()))
            conn.proto.sent(FrameType.HELLO)
            header, body = _read_frame_blocking(sock, conn.proto)
            if header.type is FrameType.ERROR:
                err = pb.DataError.FromString(body)
                raise errors.Unavailable(f"data-plane HELLO refused by {address}: {err.code}: {err.message}")
        except BaseException:
            sock.close()
            raise
        return conn

    async def _connect(self, address: str) -> _Conn:
        loop = asyncio.get_running_loop()
        if self.tls is not None:
            hello = pb.DataHello()
            hello.CopyFrom(self.hello)
            hello.data_token = self._tokens.get(address, b"")
            return await loop.run_in_executor(self._pool, self._connect_tls, address, hello)
        host, port = _split(address)
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, stype, proto, _, addr = infos[0]
        sock = socket.socket(family, stype, proto)
        sock.setblocking(False)
        _tune(sock)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, addr), self.stall_timeout_s)
            conn = _Conn(sock)
            hello = pb.DataHello()
            hello.CopyFrom(self.hello)
            hello.data_token = self._tokens.get(address, b"")
            await loop.sock_sendall(sock, encode(FrameType.HELLO, hello.SerializeToString()))
            conn.proto.sent(FrameType.HELLO)
            ftype, _, length = await asyncio.wait_for(_recv_frame(loop, sock, conn.proto), self.stall_timeout_s)
            if ftype is FrameType.ERROR:
                err = pb.DataError.FromString(await _recv_body(loop, sock, length))
                # The owner may have restarted and forgotten us: worth a fresh handshake.
                raise errors.Unavailable(f"data-plane HELLO refused by {address}: {err.code}: {err.message}")
        except BaseException:
            sock.close()
            raise
        return conn

    async def read(self, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
                   local_source: LocalSource | None = None) -> int:
        """Move every segment; with ``local_source`` (same host) only the
        authorisation crosses the socket and the bytes are copied in place."""
        slots = self._slots.setdefault(address, asyncio.Semaphore(self.connections_per_peer))
        async with slots:
            idle = self._idle.setdefault(address, [])
            conn = idle.pop() if idle else await self._connect(address)
            conn.cancel.clear()
            try:
                if conn.tls:
                    moved = await self._in_thread(conn, self._read_tls, conn, read, sinks, landed, local_source)
                elif local_source is not None:
                    moved = await self._read_local(conn, read, sinks, landed, local_source)
                elif self.nixl is not None:
                    moved = await self._read_nixl(conn, address, read, sinks, landed)
                else:
                    moved = await self._read_on(conn, read, sinks, landed)
            except BaseException:
                await self._abandon(conn)
                raise
            idle.append(conn)
            return moved

    async def _in_thread(self, conn: _Conn, fn: Callable[..., Any], *args: Any) -> Any:
        conn.work = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await conn.work
        finally:
            if conn.work.done():
                conn.work = None

    async def _abandon(self, conn: _Conn) -> None:
        """Stop a read for good before its failure is reported: flag it, shut the
        socket so a blocked recv returns, and wait for the thread to finish."""
        conn.cancel.set()
        if not conn.tls:  # a TLS socket is shut by its own thread (shutdown races SSL state)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        work = conn.work
        if work is not None and not work.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(work), self.stall_timeout_s + 5)
        conn.sock.close()

    def _read_tls(self, conn: _Conn, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
                  local_source: LocalSource | None) -> int:
        """A whole read over a TLS connection, in a worker thread."""
        sock = conn.sock
        sock.settimeout(self.stall_timeout_s)
        if local_source is not None:
            sock.sendall(_frame(FrameType.READ, read_to_pb(read).SerializeToString(), FLAG_LOCAL))
            conn.proto.sent(FrameType.READ, segments=0)
            header, body = _read_frame_blocking(sock, conn.proto)
            if header.type is FrameType.ERROR:
                err = pb.DataError.FromString(body)
                raise errors.from_code(err.code, err.message)
            moved = copy_local(read, sinks, landed, local_source, conn.cancel, self.copier)
            sock.sendall(encode(FrameType.ACK))
            conn.proto.sent(FrameType.ACK)
            return moved
        sock.sendall(encode(FrameType.READ, read_to_pb(read).SerializeToString()))
        conn.proto.sent(FrameType.READ, segments=len(sinks))
        return _recv_segments(sock, conn.proto, sinks, landed, conn.staging, self.stall_timeout_s, self.on_relayout, conn.cancel, self._land_pool)

    async def _request(self, conn: _Conn, read: DataRead, flags: int, segments: int) -> bytes:
        """Send a flagged READ and return the body of the owner's one control
        answer (END, or DESCS), raising its ERROR."""
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(conn.sock, _frame(FrameType.READ, read_to_pb(read).SerializeToString(), flags))
        conn.proto.sent(FrameType.READ, segments=segments)
        async with asyncio.timeout(self.stall_timeout_s):
            ftype, _, length = await _recv_frame(loop, conn.sock, conn.proto)
            body = await _recv_body(loop, conn.sock, length)
        if ftype is FrameType.ERROR:
            err = pb.DataError.FromString(body)
            raise errors.from_code(err.code, err.message)
        return body

    async def _ack(self, conn: _Conn) -> None:
        """Every byte of the read landed: the owner may end the rank's publication."""
        await asyncio.get_running_loop().sock_sendall(conn.sock, encode(FrameType.ACK))
        conn.proto.sent(FrameType.ACK)

    async def _read_local(self, conn: _Conn, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool], source: LocalSource) -> int:
        # Authorisation first, then the copy: copying while the owner decides
        # would save a round trip, but a refused read (a capability that does
        # not match, a publication that ended) would already have written
        # another request's bytes into this engine's memory.
        await self._request(conn, read, FLAG_LOCAL, 0)
        t0 = time.perf_counter()
        moved = await self._in_thread(conn, copy_local, read, sinks, landed, source, conn.cancel, self.copier)
        self.on_relayout(time.perf_counter() - t0)
        await self._ack(conn)
        return moved

    async def _read_on(self, conn: _Conn, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool]) -> int:
        loop = asyncio.get_running_loop()
        sock = conn.sock
        await loop.sock_sendall(sock, encode(FrameType.READ, read_to_pb(read).SerializeToString()))
        conn.proto.sent(FrameType.READ, segments=len(sinks))
        return int(await self._in_thread(conn, _recv_segments, sock, conn.proto, sinks, landed, conn.staging, self.stall_timeout_s,
                                         self.on_relayout, conn.cancel, self._land_pool))

    async def _read_nixl(self, conn: _Conn, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool]) -> int:
        """The owner exposes every segment; one NIXL READ moves them all."""
        assert self.nixl is not None
        loop = asyncio.get_running_loop()
        sock = conn.sock
        known = self._nixl_peers.get(address)
        read = dataclasses.replace(read, nixl_metadata_version=known[1] if known else 0)
        msg = pb.DataDescriptors.FromString(await self._request(conn, read, FLAG_NIXL, len(sinks)))
        if msg.agent_metadata:
            name = await loop.run_in_executor(self._pool, self.nixl.add_remote, msg.agent_metadata)
            if msg.metadata_version >= self._nixl_peers.get(address, ("", 0))[1]:
                self._nixl_peers[address] = (name, msg.metadata_version)
        if self._nixl_peers.get(address, ("", 0))[0] != msg.agent_name:
            raise errors.FailedPrecondition(f"{address} answered for NIXL agent {msg.agent_name!r}, whose metadata we do not hold")
        if conn.arena is None:
            conn.arena = Arena(self.nixl)
        moved = await self._in_thread(conn, land, self.nixl, msg, sinks, landed, conn.arena, conn.cancel, self.stall_timeout_s, self.on_relayout)
        async with asyncio.timeout(self.stall_timeout_s):
            _end, _, length = await _recv_frame(loop, sock, conn.proto)  # END: the owner sends it right after DESCS
            await _recv_body(loop, sock, length)
        await self._ack(conn)
        return int(moved)

    def staging_buffers(self) -> int:
        return sum(sum(1 for b in c.staging if b.nbytes) + (1 if c.arena and c.arena.buf.numel() else 0) for conns in self._idle.values() for c in conns)

    def staging_bytes(self) -> int:
        return sum(sum(b.nbytes for b in c.staging) + (c.arena.buf.numel() if c.arena else 0) for conns in self._idle.values() for c in conns)

    def set_token(self, address: str, data_token: bytes) -> None:
        """The secret ``address``'s owner issued us in its handshake."""
        self._tokens[address] = data_token

    async def forget(self, address: str) -> None:
        """Drop pooled connections to ``address`` (its daemon may have restarted)."""
        self._nixl_peers.pop(address, None)
        for c in self._idle.pop(address, []):
            c.sock.close()
            if c.arena is not None:
                c.arena.release()

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.sock.close()
        self._idle.clear()
        self.copier.close()
        self._land_pool.shutdown(wait=False, cancel_futures=True)


def _frame(type_: FrameType, body: bytes, flags: int = 0) -> bytes:
    return Header(type_, 0, len(body), flags).encode() + body
