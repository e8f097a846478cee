"""The reader's data plane: reads from peers over a small pool of connections.

A read runs in one worker thread from its READ to its ACK, over a blocking
``FrameSocket``, plain or TLS alike; the event loop only waits for it. What
crosses depends on the owner: over TCP, each DATA frame is received straight
into place (``recvmsg`` with MSG_WAITALL into the segment's pieces) when
local memory has the wire layout, else into one of two (pinned) staging
buffers whose relayout runs in another thread, on the GPU for GPU caches,
while the next frame arrives; on the same host the owner only authorises
and ``kvd.transport.samehost`` copies; with NIXL the owner answers where the
bytes lie and ``kvd.transport.nixl`` reads them. The ACK is sent by the
thread that saw the last byte land.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvd.core import errors
from kvd.core.reads import DataRead
from kvd.core.session import Ack, Data, Descriptors, End, Error, Event, Hello, ProtocolError, Read
from kvd.core.sinks import SegmentSink
from kvd.proto import kvd_pb2 as pb
from kvd.transport.base import Staging
from kvd.transport.copy_threads import Batch, CopyThreads
from kvd.transport.device import device_copies
from kvd.transport.framing import FrameSocket, as_bytes, split_address, tune
from kvd.transport.iovec import Copier
from kvd.transport.nixl import Arena, NixlAgent, land
from kvd.transport.samehost import LocalSource, copy_local


class _Conn:
    def __init__(self, fs: FrameSocket) -> None:
        self.fs = fs
        # Set when the read is abandoned; worker threads check it before every
        # frame and every landing, so nothing lands after a failure is reported.
        self.cancel = threading.Event()
        self.work: asyncio.Future[Any] | None = None
        # Received segments awaiting relayout (one lands while the other
        # fills); pinned where a GPU may take them, for full-speed uploads.
        self.staging = (Staging(pinned=True), Staging(pinned=True))
        self.arena: Arena | None = None  # NIXL landing scratch, registered on first use


class TcpDataClient:
    name = "tcp"

    def __init__(self, hello: Hello, *, connections_per_peer: int = 4, copy_threads: int = 2, stall_timeout_s: float = 30.0,
                 stream_wait_s: float = 60.0, on_relayout: Callable[[float], None] = lambda seconds: None, tls: ssl.SSLContext | None = None,
                 nixl: NixlAgent | None = None) -> None:
        self.on_relayout = on_relayout
        self.nixl = nixl  # transport nixl: bulk bytes by NIXL READ, control on this connection
        self.tls = tls  # mTLS: every connection is wrapped before its HELLO
        self.hello = hello
        self.connections_per_peer = connections_per_peer
        self.stall_timeout_s = stall_timeout_s
        # A streaming read waits for prefill to compute: each layer over TCP,
        # the whole prompt same-host or over NIXL. Bounded by the pull's own
        # timeout; the owner fails a read whose next layer does not come.
        self.stream_wait_s = stream_wait_s
        self._idle: dict[str, list[_Conn]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._tokens: dict[str, bytes] = {}
        self._nixl_peers: dict[str, tuple[str, int]] = {}  # data address -> (owner's NIXL agent, metadata version loaded)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="kvd-recv")
        # Copies on every core: same-host piece copies and relayouts.
        self.copy_threads = CopyThreads(copy_threads)
        self.copier = Copier(pool=self.copy_threads)
        # Relayout of received segments bound for a GPU (host ones land on the copy threads).
        self._land_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvd-land")

    def _connect(self, address: str) -> _Conn:
        """A new connection, its HELLO answered (in a worker thread)."""
        host, port = split_address(address)
        raw = socket.create_connection((host, port), timeout=self.stall_timeout_s)
        sock = raw
        try:
            tune(raw)
            if self.tls is not None:
                sock = self.tls.wrap_socket(raw, server_hostname=host)
            fs = FrameSocket(sock, owner=False)
            with fs.stall_bound(self.stall_timeout_s):
                fs.send(dataclasses.replace(self.hello, data_token=self._tokens.get(address, b"")))
                answer = fs.next_event()
            if isinstance(answer, Error):
                # The owner may have restarted and forgotten us: worth a fresh handshake.
                raise errors.Unavailable(f"data-plane HELLO refused by {address}: {answer.code}: {answer.message}")
        except BaseException:
            sock.close()
            raise
        return _Conn(fs)

    async def read(self, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
                   local_source: LocalSource | None = None) -> int:
        """Move every segment; with ``local_source`` (same host) only the
        authorisation crosses the socket and the bytes are copied in place."""
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(address, asyncio.Semaphore(self.connections_per_peer))
        async with slots:
            idle = self._idle.setdefault(address, [])
            conn = idle.pop() if idle else await loop.run_in_executor(self._pool, self._connect, address)
            conn.cancel.clear()
            try:
                # The READ leaves from here, as far as the socket takes it
                # without blocking (all of it, unless it is megabytes): the
                # owner authorises while the thread that reads the answer
                # wakes, instead of after (0.4 ms of the bench's small request).
                frame = memoryview(conn.fs.session.send(self._request(address, read, local_source)))
                rest = frame[conn.fs.send_nowait(frame):]
            except BaseException:
                conn.fs.close()
                raise
            conn.work = loop.run_in_executor(self._pool, self._read, conn, address, read, sinks, landed, local_source, rest)
            try:
                # Shielded: a cancelled pull abandons the read (below) and
                # waits for its thread, so nothing lands after it is reported.
                moved = await asyncio.shield(conn.work)
            except BaseException:
                await self._abandon(conn)
                raise
            conn.work = None
            idle.append(conn)
            return int(moved)

    async def _abandon(self, conn: _Conn) -> None:
        """Stop a read for good before its failure is reported: flag it, shut the
        socket so a blocked recv returns, and wait for the thread to finish."""
        conn.cancel.set()
        if not conn.fs.tls:  # a TLS socket is shut by its own thread (shutdown races SSL state)
            with contextlib.suppress(OSError):
                conn.fs.sock.shutdown(socket.SHUT_RDWR)
        work = conn.work
        if work is not None and not work.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(work), self.stall_timeout_s + 5)
        conn.fs.close()

    def _request(self, address: str, read: DataRead, source: LocalSource | None) -> Read:
        """The READ that opens ``read``: flagged LOCAL (same host: authorise
        only) or NIXL (answer where the bytes lie), else plain."""
        if source is not None:
            return Read(dataclasses.replace(read, mapped_registration=source.registration), local=True)
        if self.nixl is not None:
            known = self._nixl_peers.get(address)
            return Read(dataclasses.replace(read, nixl_metadata_version=known[1] if known else 0), nixl=True)
        return Read(read)

    def _read(self, conn: _Conn, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
              source: LocalSource | None, unsent: memoryview) -> int:
        """One whole read, in a worker thread. A stall is not retried: the
        peer is alive enough to hold the connection, and a retry would only
        wait as long again; the pull fails at the stall, naming the peer."""
        try:
            return self._read_stalling(conn, address, read, sinks, landed, source, unsent)
        except TimeoutError:
            raise errors.DeadlineExceeded(f"data plane stalled: engine {read.owner_engine_id!r} at {address} sent nothing "
                                          f"for {self.stall_timeout_s:g}s (stall_timeout_seconds)") from None

    def _read_stalling(self, conn: _Conn, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
                       source: LocalSource | None, unsent: memoryview) -> int:
        fs = conn.fs
        with fs.stall_bound(max(self.stall_timeout_s, self.stream_wait_s) if read.stream else self.stall_timeout_s):
            fs.sock.sendall(unsent)  # what of the READ the loop could not send
            if source is not None:
                # Authorisation first, then the copy: copying while the owner
                # decides would save a round trip, but a refused read would
                # already have written another request's bytes into our memory.
                _expect(fs.next_event(), End)
                t0 = time.perf_counter()
                moved = copy_local(read, sinks, landed, source, conn.cancel, self.copier, self.copy_threads.run_copies)
                self.on_relayout(time.perf_counter() - t0)
            elif self.nixl is not None:
                moved = self._read_nixl(conn, address, read, sinks, landed)
            else:
                moved = recv_segments(fs, sinks, landed, conn.staging, self.on_relayout, conn.cancel, self.copy_threads,
                                      self._land_pool)
            # Every byte landed: the owner may end the rank's publication.
            fs.send(Ack())
            return moved

    def _read_nixl(self, conn: _Conn, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool]) -> int:
        """The owner exposes every segment; one NIXL READ moves them all."""
        assert self.nixl is not None
        fs = conn.fs
        msg = _expect(fs.next_event(), Descriptors).message
        assert isinstance(msg, pb.DataDescriptors)
        if msg.agent_metadata:
            name = self.nixl.add_remote(msg.agent_metadata)
            if msg.metadata_version >= self._nixl_peers.get(address, ("", 0))[1]:
                self._nixl_peers[address] = (name, msg.metadata_version)
        if self._nixl_peers.get(address, ("", 0))[0] != msg.agent_name:
            raise errors.FailedPrecondition(f"{address} answered for NIXL agent {msg.agent_name!r}, whose metadata we do not hold")
        if conn.arena is None:
            conn.arena = Arena(self.nixl)
        moved = land(self.nixl, msg, sinks, landed, conn.arena, conn.cancel, self.stall_timeout_s, self.on_relayout,
                     self.copy_threads.run_copies)
        _expect(fs.next_event(), End)  # the owner sends it right after DESCS
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
            c.fs.close()
            if c.arena is not None:
                c.arena.release()

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.fs.close()
        self._idle.clear()
        self.copier.close()
        self.copy_threads.close()
        self._land_pool.shutdown(wait=False, cancel_futures=True)


def _expect(ev: Event, kind: type) -> Any:
    """The owner's one control answer, or its ERROR raised as the error it names."""
    if isinstance(ev, Error):
        raise errors.from_code(ev.code, ev.message)
    if not isinstance(ev, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(ev).__name__}")
    return ev


class _Landing:
    """Relayout off the receiving thread, so that segment k lands while
    segment k+1 arrives: a host segment as a batch on the copy threads (they
    take the next batch without sleeping, however many connections feed
    them), a GPU one in a landing thread, on that thread's stream. Each
    staging buffer has at most one landing in flight. ``wait`` before
    reporting anything, so no byte lands after a failure is reported."""

    def __init__(self, threads: CopyThreads, pool: concurrent.futures.Executor, buffers: tuple[Staging, ...], landed: list[bool],
                 on_relayout: Callable[[float], None], cancel: threading.Event) -> None:
        self.threads, self.pool, self.buffers, self.landed = threads, pool, buffers, landed
        self.on_relayout, self.cancel = on_relayout, cancel
        self.next = 0
        self.pending: list[Batch | concurrent.futures.Future[None] | None] = [None] * len(buffers)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The next buffer, once no landing is reading it."""
        self._wait(self.next)
        return self.buffers[self.next](nbytes)

    def submit(self, sink: SegmentSink, buf: torch.Tensor, tag: int) -> None:
        if self.cancel.is_set():
            raise ConnectionAbortedError("read abandoned")
        if sink.device.type == "cpu":
            def done(batch: Batch) -> None:
                if batch.failure is None:
                    self.on_relayout(batch.seconds)
                    self.landed[tag] = True

            self.pending[self.next] = self.threads.submit_copies(sink.put_copies(buf), done, self.cancel)
        else:
            self.pending[self.next] = self.pool.submit(self._land_on_device, sink, buf, tag)
        self.next = (self.next + 1) % len(self.buffers)

    def _land_on_device(self, sink: SegmentSink, buf: torch.Tensor, tag: int) -> None:
        if self.cancel.is_set():
            raise ConnectionAbortedError("read abandoned")
        t0 = time.perf_counter()
        with device_copies(sink.device):  # this thread's stream: beside other connections' landings
            sink.land(buf)
        self.on_relayout(time.perf_counter() - t0)
        self.landed[tag] = True

    def _wait(self, slot: int) -> None:
        pending, self.pending[slot] = self.pending[slot], None
        if isinstance(pending, Batch):
            pending.wait(help=False)
        elif pending is not None:
            pending.result()

    def wait(self) -> None:
        """Every landing finished; the first failure raised."""
        failure: BaseException | None = None
        for slot in range(len(self.pending)):
            try:
                self._wait(slot)
            except BaseException as e:
                failure = failure or e
        if failure is not None:
            raise failure


def recv_segments(fs: FrameSocket, sinks: Sequence[SegmentSink], landed: list[bool], buffers: tuple[Staging, ...],
                  on_relayout: Callable[[float], None], cancel: threading.Event, threads: CopyThreads,
                  land_pool: concurrent.futures.Executor) -> int:
    """DATA frames straight into place (or into staging, relaid out while
    the next frame arrives) until END, or ERROR raised. Returns bytes moved.

    A segment counts as landed only once the owner's next frame (DATA or
    END) arrives: the owner checks the publication alive before each, and
    the engine may reuse the blocks the moment it ends, so the bytes of the
    last segment before an ERROR, a reset or an abandoned read may be the
    reuse's."""
    moved = 0
    landing = _Landing(threads, land_pool, buffers, landed, on_relayout, cancel)
    try:
        while True:
            if cancel.is_set():
                raise ConnectionAbortedError("read abandoned")
            ev = fs.next_event()
            if isinstance(ev, Error):
                raise errors.from_code(ev.code, ev.message)
            if isinstance(ev, End):
                landing.wait()  # every byte landed
                return moved
            assert isinstance(ev, Data)
            sink = sinks[ev.tag]
            if ev.length != sink.nbytes:
                raise ProtocolError(f"segment {ev.tag} carries {ev.length} bytes, expected {sink.nbytes}")
            iov = None if fs.tls else sink.iov()
            if iov is not None:  # straight into place, scattered blocks included
                fs.recv_iov(iov)
                landed[ev.tag] = True
            else:
                buf = landing.buffer(ev.length)
                fs.recv_into(as_bytes(buf))
                landing.submit(sink, buf, ev.tag)
            moved += ev.length
    finally:
        with contextlib.suppress(BaseException):
            landing.wait()
        if fs.session.unconfirmed is not None:
            landed[fs.session.unconfirmed] = False
