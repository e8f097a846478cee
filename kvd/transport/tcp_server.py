"""The owner's data plane: serves reads of this daemon's registered memory.

The event loop accepts; each connection is then driven by one thread over a
blocking ``FrameSocket`` for its whole life, plain or TLS alike. Decisions
(is the HELLO valid, may this read be served, the ACK) are the daemon's and
run on its event loop (``ReadServer``); the thread only moves bytes and
frames. The bytes cross by the byte mover the READ asks for (``Read.via``,
one of the connection's ``ServeMover``s): DATA frames (``FramesOut``), nothing
where the reader copies our memory itself (``samehost.SameHostOut``), or one
DESCS frame for a NIXL READ (``nixl.NixlOut``). A DATA frame leaves straight from registered memory, one
``sendmsg`` over the segment's pieces, or from a per-connection staging
buffer when those bytes are not dense pieces there (a head slice of an
interleaved layout). GPU memory is gathered on the GPU and copied to pinned
memory on a side stream while the previous segment is sent
(``kvd.transport.device``).

The publication is checked alive before every frame after a DATA frame
(the next DATA, or END): the engine may reuse the blocks the moment the
publication ends, so a DATA frame is safe only once the frame after it
went out, and the reader counts a segment as landed only then. A
streaming publication's segment leaves only once prefill saved its layers
(``OpenRead.wait_saved``); the thread waits for them between segments.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.core import errors
from kvd.core.reads import DataRead
from kvd.core.session import Ack, End, Error, Hello, HelloOk, ProtocolError, Read
from kvd.transport.base import Gate, OpenRead, ReadServer, ServeMover, Staging
from kvd.transport.device import DeviceToHost
from kvd.transport.framing import SOCKET_BUFFER_BYTES, FrameSocket, tune
from kvd.transport.nixl import Arena, NixlAgent, NixlOut
from kvd.transport.samehost import SameHostOut
from kvd.transport.thread_nice import set_thread_nice
from kvd.transport.wire_gate import WireGate

log = logging.getLogger("kvd.tcp")


class TcpDataServer:
    def __init__(self, server: ReadServer, host: str, port: int, *, hello_timeout_s: float = 10.0,
                 max_connections_per_peer: int = 16, max_connections: int = 256, tls: ssl.SSLContext | None = None,
                 nixl: NixlAgent | None = None, nixl_staging_bytes: int = 1 << 30,
                 pinned_read_timeout_s: float = 60.0, gate: WireGate | None = None) -> None:
        self.server = server
        self.gate = gate  # --qos on: reads' sends in the wire's order
        self.tls = tls  # mTLS: every connection is wrapped before its HELLO
        self.nixl = nixl  # transport nixl: reads may ask for descriptors instead of DATA
        self.nixl_staging_bytes = nixl_staging_bytes
        self.host, self.port = host, port
        self.hello_timeout_s = hello_timeout_s
        # How long a reader that copies our memory itself (same host, NIXL)
        # may keep its rank pinned before it ACKs: a local copy or a NIXL
        # READ of one read takes seconds at most; past this the reader is
        # taken as hung and the connection closed.
        self.pinned_read_timeout_s = pinned_read_timeout_s
        # Each connection holds at most two segments of staging, and a slow
        # reader only blocks its own thread; capping connections caps memory.
        self.max_connections_per_peer = max_connections_per_peer
        self.max_connections = max_connections
        self._readers: collections.Counter[tuple[str, str]] = collections.Counter()  # open connections by (engine id, epoch)
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._loop = asyncio.get_running_loop()
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
            if len(self._conns) >= self.max_connections:
                conn.close()  # over the overall cap: refuse before reading a byte
                continue
            tune(conn, self.gate.chunk_bytes if self.gate is not None else SOCKET_BUFFER_BYTES)
            self._conns.add(conn)
            # A thread per connection, for its whole life: pooled threads
            # would run out with idle reader connections.
            t = threading.Thread(target=self._serve, args=(conn,), name="kvd-serve", daemon=True)
            self._threads.add(t)
            t.start()

    def _on_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a daemon method on its event loop (its state is only touched
        there) and return its result or raise its error."""
        assert self._loop is not None
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():
                return  # the thread gave up waiting: running it now would take a slot nobody releases
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as e:
                done.set_exception(e)

        try:
            self._loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop has closed: the daemon is gone, so is this connection
            raise ConnectionAbortedError("the daemon is shutting down") from None
        # Bounded: a loop that stops before it runs ``run`` would leave this thread waiting for good.
        concurrent.futures.wait([done], timeout=self.hello_timeout_s)
        if not done.done() and done.cancel():  # never ran, and now never will
            if self._loop.is_closed() or not self._loop.is_running():
                raise ConnectionAbortedError("the daemon is shutting down")
            raise TimeoutError(f"the daemon's event loop did not answer in {self.hello_timeout_s:g}s")
        return done.result()  # it ran, or is running on the loop now: its outcome, whatever it is

    def _later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a daemon method on its loop without waiting: calls from one
        connection still run in order."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._loop.call_soon_threadsafe(fn, *args)

    def _serve(self, raw: socket.socket) -> None:
        peer_key: tuple[str, str] | None = None
        arena = Arena(self.nixl) if self.nixl is not None else None
        sock = raw
        try:
            raw.setblocking(True)
            if self.tls is not None:
                raw.settimeout(self.hello_timeout_s)
                try:
                    sock = self.tls.wrap_socket(raw, server_side=True)  # no or wrong certificate: fails here
                except (ssl.SSLError, OSError) as e:
                    log.info("data-plane TLS handshake refused: %s", e)
                    return
            fs = FrameSocket(sock, owner=True)
            with fs.stall_bound(self.hello_timeout_s):  # the whole HELLO, body included
                hello = fs.next_event()
                assert isinstance(hello, Hello)
                try:
                    self._on_loop(self.server.check_hello, hello)
                    self._on_loop(self._take_slot, hello.engine_id, hello.epoch)
                    peer_key = (hello.engine_id, hello.epoch)
                except errors.KvdError as e:
                    fs.send(Error.of(e))
                    return
                fs.send(HelloOk())
            if self.gate is not None and hello.lane == "bulk":
                # The reader keeps this connection for reads below class
                # interactive: its thread yields the CPU (thread_nice) for good,
                # as it will never serve an interactive read. A connection that
                # may carry any class (a reader with qos off, or an older one)
                # is never niced: a thread's nice is not lowered again.
                set_thread_nice(self.gate.bulk_nice)
            movers = self._movers(fs, arena)
            while True:
                with fs.stall_bound(None):  # idle between reads
                    ev = fs.next_event()  # only READ is admitted here
                assert isinstance(ev, Read)
                came_in = time.perf_counter()
                try:
                    opened = self.server.open_read(hello, ev.read, local=ev.local, reader_copies=ev.nixl)
                except errors.KvdError as e:
                    fs.send(Error.of(e))
                    continue
                try:
                    with fs.stall_bound(self.hello_timeout_s * 3):
                        if not self._answer(fs, opened, ev, movers):
                            continue
                    opened.served(time.perf_counter() - came_in)
                    # A reader that copies our memory itself holds its pin until
                    # this ACK; one that never sends it may not hold it forever.
                    with fs.stall_bound(self.pinned_read_timeout_s if opened.pin is not None else None):
                        ack = fs.next_event()
                    assert isinstance(ack, Ack)
                    self._later(opened.acknowledged)
                finally:
                    self._later(opened.close)
        except (ConnectionError, OSError):
            pass  # the reader went away (or we are closing)
        except (TimeoutError, ProtocolError) as e:
            log.warning("data-plane connection closed: %s", e)
        except Exception:
            log.exception("data-plane connection failed")
        finally:
            if peer_key is not None:
                self._later(self._release_slot, *peer_key)
            self._conns.discard(raw)
            sock.close()
            if arena is not None:
                arena.release()
            self._threads.discard(threading.current_thread())

    def _movers(self, fs: FrameSocket, arena: Arena | None) -> dict[str, ServeMover]:
        """The byte movers this connection offers, by the name a READ asks for."""
        movers: list[ServeMover] = [FramesOut(Staging(), DeviceToHost(), self.gate), SameHostOut()]
        if self.nixl is not None and arena is not None and not fs.tls:
            movers.append(NixlOut(self.nixl, arena, self.nixl_staging_bytes))
        return {m.name: m for m in movers}

    def _answer(self, fs: FrameSocket, opened: OpenRead, ev: Read, movers: dict[str, ServeMover]) -> bool:
        """One authorised read: what its mover sends (DATA frames, one DESCS,
        or nothing), then END, or ERROR. True after END (the reader's ACK follows)."""
        mover = movers.get(ev.via)
        failed: errors.KvdError | None = None
        total = 0
        try:
            if mover is None:
                raise errors.FailedPrecondition(self._not_offered(fs, ev.via))
            total = mover.serve(fs, opened, ev.read)
        except errors.KvdError as e:
            failed = e
        if failed is not None:
            fs.send(Error.of(failed))
            return False
        fs.send(End(total))
        return True

    def _not_offered(self, fs: FrameSocket, via: str) -> str:
        if via == "nixl" and fs.tls:
            return "transport nixl is not offered over an mTLS data plane (NIXL traffic is not encrypted)"
        if via == "nixl":
            return "this daemon's data plane has no NIXL agent (set transport: nixl on both sides)"
        return f"this data plane offers no {via!r} byte mover"

    def _take_slot(self, engine_id: str, epoch: str) -> None:
        """Per-reader connection accounting, always on the loop: the limit
        counts the engine's connections over all its epochs."""
        if sum(n for (engine, _), n in self._readers.items() if engine == engine_id) >= self.max_connections_per_peer:
            raise errors.ResourceExhausted(f"engine {engine_id!r} already has {self.max_connections_per_peer} data connections")
        self._readers[(engine_id, epoch)] += 1

    def _release_slot(self, engine_id: str, epoch: str) -> None:
        self._readers[(engine_id, epoch)] -= 1
        if self._readers[(engine_id, epoch)] <= 0:
            del self._readers[(engine_id, epoch)]

    def connected_readers(self) -> set[tuple[str, str]]:
        """The readers (engine id, epoch) holding a data connection now (on the loop)."""
        return set(self._readers)

    async def close(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        if self._sock is not None:
            self._sock.close()
        for conn in list(self._conns):  # a blocked recv or send returns at once
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = asyncio.get_running_loop().time() + 5
        while self._threads and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # they hop to the loop on their way out


class FramesOut:
    """The owner's half of the TCP mover, one a data connection: DATA frames
    (``send_segments``), the publication checked alive once the last left."""

    name = "tcp"

    def __init__(self, staging: Staging, to_host: DeviceToHost, gate: WireGate | None = None) -> None:
        self.staging, self.to_host, self.gate = staging, to_host, gate

    def serve(self, fs: FrameSocket, opened: OpenRead, read: DataRead) -> int:
        gate = None if self.gate is None else self.gate.for_peer(read)
        try:
            total = send_segments(fs, opened, len(read.segments), self.staging, self.to_host, gate)
        finally:
            if gate is not None:
                gate.close()
        # Every byte left while the publication was alive: only then END,
        # as the engine may reuse the blocks once it ends.
        opened.check_alive()
        return total


def send_segments(fs: FrameSocket, opened: OpenRead, count: int, staging: Staging, to_host: DeviceToHost, gate: Gate | None = None) -> int:
    """Every DATA frame of one read, segment by segment, checking the
    publication before each. Host memory leaves in place (one sendmsg over
    its pieces); the rest is gathered into staging first. A GPU segment is
    gathered and copied down while the segment before it is on the wire
    (``DeviceToHost``). Returns payload bytes."""
    total = 0

    def start_on_device(i: int) -> bool:
        device = opened.segment_device(i)
        if device.type == "cpu":
            return False
        to_host.start(i, device, functools.partial(opened.segment, i))
        return True

    try:
        for i in range(count):
            opened.wait_saved(i)
            opened.check_alive()
            # --qos on: the read asks for the wire again as this segment ends only
            # if its next one is saved by then; one that waits for prefill holds no place.
            more = functools.partial(next_saved, opened, i, count)
            iov: np.ndarray | None = None if fs.tls else opened.segment_iov(i)
            if iov is not None:
                n = fs.send_data(i, iov, gate, more)
                opened.count_sent(n, opened.segment_blocks(i), "tcp")
            elif start_on_device(i):
                if more():
                    start_on_device(i + 1)  # its copy runs while this one is sent
                n = fs.send_data(i, to_host.take(i), gate, more)
            else:
                n = fs.send_data(i, opened.segment(i, staging), gate, more)
            total += n
        return total
    finally:
        to_host.drain()


def next_saved(opened: OpenRead, i: int, count: int) -> bool:
    """Whether segment ``i``'s next one exists and may be sent now."""
    return i + 1 < count and opened.saved(i + 1)
