"""The reader's data plane: reads from peers over a small pool of connections.

A read runs in one worker thread from its READ to its ACK, over a blocking
``FrameSocket``, plain or TLS alike; the event loop only waits for it. The
bytes cross by a byte mover (``kvd.transport.base.ReadMover``), chosen by
what this daemon can do: where the owner's memory is mapped here (same
host), ``samehost.SameHostIn`` copies it after the owner authorised; else the
connection's own: ``nixl.NixlIn`` where this daemon has a NIXL agent, else
``FramesIn``, DATA frames received straight into place (``recvmsg`` with
MSG_WAITALL into the segment's pieces) when local memory has the wire
layout, or into one of two (pinned) staging buffers whose relayout runs in
another thread, on the GPU for GPU caches, while the next frame arrives.
The ACK is sent by the thread that saw the last byte land.
"""

from __future__ import annotations

import asyncio
import collections
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
from kvd.core.qos import CLASSES, QosTag, QueueStatus
from kvd.core.reads import DataRead
from kvd.core.session import Ack, Data, End, Error, Hello, ProtocolError, Read
from kvd.core.sinks import SegmentSink
from kvd.transport.base import Gate, ReadMover, Staging
from kvd.transport.copy_threads import Batch, CopyThreads
from kvd.transport.device import device_copies
from kvd.transport.framing import SOCKET_BUFFER_BYTES, FrameSocket, as_bytes, split_address, tune
from kvd.transport.iovec import Copier
from kvd.transport.nixl import NixlAgent, NixlIn
from kvd.transport.samehost import LocalSource, SameHostIn
from kvd.transport.thread_nice import set_thread_nice
from kvd.transport.wire_gate import Admission, ReadGate, WireGate


class FramesIn:
    """The reader's half of the TCP mover, one a data connection: DATA frames
    until END (``recv_segments``)."""

    name = "tcp"

    def __init__(self, threads: CopyThreads, land_pool: concurrent.futures.Executor, on_relayout: Callable[[float], None]) -> None:
        self.threads, self.land_pool, self.on_relayout = threads, land_pool, on_relayout
        # Received segments awaiting relayout (one lands while the other
        # fills); pinned where a GPU may take them, for full-speed uploads.
        self.staging = (Staging(pinned=True), Staging(pinned=True))

    def request(self, read: DataRead) -> Read:
        return Read(read)

    def land(self, fs: FrameSocket, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
             cancel: threading.Event, gate: Gate | None = None) -> int:
        # Over TCP the owner orders the wire by pacing its sends (--qos on): a
        # reader that paced its receives too could hold its place waiting for
        # bytes the owner holds back for another read, and both would stall.
        return recv_segments(fs, sinks, landed, self.staging, self.on_relayout, cancel, self.threads, self.land_pool)

    def scratch(self) -> list[int]:
        return [b.nbytes for b in self.staging if b.nbytes]

    def close(self) -> None:
        pass


class _Conn:
    def __init__(self, fs: FrameSocket, mover: ReadMover) -> None:
        self.fs = fs
        self.mover = mover  # how bytes from this owner cross, unless its memory is mapped here
        # Set when the read is abandoned; worker threads check it before every
        # frame and every landing, so nothing lands after a failure is reported.
        self.cancel = threading.Event()
        self.work: asyncio.Future[Any] | None = None

    def close(self) -> None:
        """Close the socket and the mover's scratch (no thread may still be in a read on it)."""
        self.fs.close()
        self.mover.close()


class TcpDataClient:
    name = "tcp"

    def __init__(self, hello: Hello, *, connections_per_peer: int = 4, copy_threads: int = 2, stall_timeout_s: float = 30.0,
                 stream_wait_s: float = 60.0, on_relayout: Callable[[float], None] = lambda seconds: None, tls: ssl.SSLContext | None = None,
                 nixl: NixlAgent | None = None, gate: WireGate | None = None) -> None:
        self.on_relayout = on_relayout
        self.gate = gate  # --qos on: the wire's order
        self.nixl = nixl  # transport nixl: bulk bytes by NIXL READ, control on this connection
        self.tls = tls  # mTLS: every connection is wrapped before its HELLO
        self.hello = hello
        self.connections_per_peer = connections_per_peer
        self.stall_timeout_s = stall_timeout_s
        # A streaming read waits for prefill to compute: each layer over TCP,
        # the whole prompt same-host or over NIXL. Bounded by the pull's own
        # timeout; the owner fails a read whose next layer does not come.
        self.stream_wait_s = stream_wait_s
        self._idle: dict[str, list[_Conn]] = {}  # by peer address; --qos on, by "<address> <lane>" (interactive, bulk)
        # Bumped by ``forget``: a connection taken before then is closed when its read ends, not pooled.
        self._epochs: dict[str, int] = {}
        self._closed = False
        self._slots: dict[str, asyncio.Semaphore] = {}  # a peer's connections, first come first served
        self._admission: dict[str, Admission] = {}  # --qos on: the same in the wire's order
        self._tokens: dict[str, bytes] = {}
        self._reading: collections.Counter[str] = collections.Counter()  # reads under way, by peer address
        self._nixl_peers: dict[str, tuple[str, int]] = {}  # data address -> (owner's NIXL agent, metadata version loaded)
        # Copies on every core (same-host piece copies and relayouts), a lane's on threads of its own.
        self._normal = self._bulk = _Lane.start("", copy_threads)
        if gate is not None and gate.bulk_nice != gate.normal_nice:
            # --qos on: reads of the other classes run in threads that yield the CPU
            # to the interactive ones' (thread_nice: a thread's nice is not lowered again),
            # and land on copy threads of their own: an interactive read's
            # landings never queue behind a bulk read's.
            self._bulk = _Lane.start("-bulk", copy_threads, gate.bulk_nice)

    def _connect(self, address: str, lane: _Lane, carries: str) -> _Conn:
        """A new connection, its HELLO answered (in a worker thread of ``lane``),
        whose reads ``lane``'s threads land; ``carries``: the reads it will
        carry, as its HELLO tells the owner ("bulk", "interactive", "": any)."""
        host, port = split_address(address)
        raw = socket.create_connection((host, port), timeout=self.stall_timeout_s)
        sock = raw
        try:
            tune(raw, self.gate.chunk_bytes if self.gate is not None else SOCKET_BUFFER_BYTES)
            if self.tls is not None:
                sock = self.tls.wrap_socket(raw, server_hostname=host)
            fs = FrameSocket(sock, owner=False)
            with fs.stall_bound(self.stall_timeout_s):
                fs.send(dataclasses.replace(self.hello, data_token=self._tokens.get(address, b""), lane=carries))
                answer = fs.next_event()
            if isinstance(answer, Error):
                # The owner may have restarted and forgotten us: worth a fresh handshake.
                raise errors.Unavailable(f"data-plane HELLO refused by {address}: {answer.code}: {answer.message}")
        except BaseException:
            sock.close()
            raise
        run = lane.copy_threads.run_copies
        mover: ReadMover = (NixlIn(self.nixl, address, self._nixl_peers, self.stall_timeout_s, self.on_relayout, run) if self.nixl is not None
                            else FramesIn(lane.copy_threads, lane.land_pool, self.on_relayout))
        return _Conn(fs, mover)

    async def read(self, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
                   local_source: LocalSource | None = None, qos: QosTag | None = None) -> int:
        """Move every segment; with ``local_source`` (same host) only the
        authorisation crosses the socket and the bytes are copied in place.
        With ``qos`` (and a gate), reads get connections in the wire's order
        (``Admission``): an interactive read has connections of its own, so
        bulk reads holding every pooled one do not keep it waiting."""
        self._reading[address] += 1
        try:
            return await self._read_pooled(address, read, sinks, landed, local_source, qos)
        finally:
            self._reading[address] -= 1
            if not self._reading[address]:
                del self._reading[address]

    async def _read_pooled(self, address: str, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
                           local_source: LocalSource | None, qos: QosTag | None) -> int:
        lane, carries = self._normal, ""  # untagged (qos off): any class, never niced
        if qos is None or self.gate is None:
            slots: contextlib.AbstractAsyncContextManager[Any] = self._slots.setdefault(address, asyncio.Semaphore(self.connections_per_peer))
        else:
            admission = self._admission.setdefault(address, Admission(self.gate.schedule.shares, self.connections_per_peer))
            slots = admission.connection(qos, sum(s.nbytes for s in sinks))
            # Each lane's connections are its own: an interactive read's stay warm
            # (a bulk read does not take them), and the owner nices only the bulk's.
            carries = CLASSES[0] if qos.priority == CLASSES[0] else "bulk"
            lane = self._bulk if carries == "bulk" else self._normal
        loop = asyncio.get_running_loop()
        async with slots:
            key, epoch = _idle_key(address, carries), self._epochs.get(address, 0)
            idle = self._idle.get(key)
            conn = idle.pop() if idle else await loop.run_in_executor(lane.pool, self._connect, address, lane, carries)
            conn.cancel.clear()
            # By what this daemon can do: the owner's memory mapped here is copied, else the connection's own mover.
            mover = conn.mover if local_source is None else SameHostIn(local_source, lane.copier, lane.copy_threads.run_copies, self.on_relayout)
            try:
                # The READ leaves from here, as far as the socket takes it
                # without blocking (all of it, unless it is megabytes): the
                # owner authorises while the thread that reads the answer
                # wakes, instead of after (0.4 ms of the bench's small request).
                frame = memoryview(conn.fs.session.send(mover.request(read)))
                rest = frame[conn.fs.send_nowait(frame):]
            except BaseException:
                conn.close()
                raise
            # The side that moves the bytes orders them: the owner its sends over
            # TCP (by the tag in the READ), this daemon its same-host copies.
            gate = None if qos is None or self.gate is None or local_source is None else self.gate.for_read(qos, conn.cancel)
            conn.work = loop.run_in_executor(lane.pool, self._read, conn, address, mover, read, sinks, landed, rest, gate)
            try:
                # Shielded: a cancelled pull abandons the read (below) and
                # waits for its thread, so nothing lands after it is reported.
                moved = await asyncio.shield(conn.work)
            except BaseException:
                await self._abandon(conn)
                raise
            conn.work = None
            if self._closed or self._epochs.get(address, 0) != epoch:  # forgotten while it read: its pool is gone
                conn.close()
            else:
                self._idle.setdefault(key, []).append(conn)
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
        if work is None or work.done():  # a thread still in it may yet use its scratch
            conn.mover.close()

    def _read(self, conn: _Conn, address: str, mover: ReadMover, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
              unsent: memoryview, gate: ReadGate | None = None) -> int:
        """One whole read, in a worker thread. A stall is not retried: the
        peer is alive enough to hold the connection, and a retry would only
        wait as long again; the pull fails at the stall, naming the peer."""
        fs = conn.fs
        try:
            with fs.stall_bound(max(self.stall_timeout_s, self.stream_wait_s) if read.stream else self.stall_timeout_s):
                fs.sock.sendall(unsent)  # what of the READ the loop could not send
                try:
                    moved = mover.land(fs, read, sinks, landed, conn.cancel, gate)
                finally:
                    if gate is not None:
                        gate.close()  # its place in the wire's queue
                # Every byte landed: the owner may end the rank's publication.
                fs.send(Ack())
                return moved
        except TimeoutError:
            raise errors.DeadlineExceeded(f"data plane stalled: engine {read.owner_engine_id!r} at {address} sent nothing "
                                          f"for {self.stall_timeout_s:g}s (stall_timeout_seconds)") from None

    def admission_queues(self) -> list[tuple[str, QueueStatus]]:
        """--qos on: per peer, this daemon's reads waiting for or holding a connection."""
        return [(f"read {address}", q) for address, a in sorted(self._admission.items()) for q in a.schedule.queues()]

    def staging_buffers(self) -> int:
        return sum(len(c.mover.scratch()) for conns in self._idle.values() for c in conns)

    def staging_bytes(self) -> int:
        return sum(sum(c.mover.scratch()) for conns in self._idle.values() for c in conns)

    def set_token(self, address: str, data_token: bytes) -> None:
        """The secret ``address``'s owner issued us in its handshake."""
        self._tokens[address] = data_token

    async def forget(self, address: str, for_good: bool = False) -> None:
        """Drop pooled connections to ``address`` (its daemon may have restarted);
        one reading now is closed when its read ends. ``for_good``: the peer
        is not read from any more; with no read under way, nothing of it is kept."""
        self._epochs[address] = self._epochs.get(address, 0) + 1
        self._nixl_peers.pop(address, None)
        for c in [c for carries in ("", CLASSES[0], "bulk") for c in self._idle.pop(_idle_key(address, carries), [])]:
            c.close()
        if for_good and not self._reading[address]:
            # Nothing waits on its connection slots or compares its epoch: a
            # daemon whose peers come and go keeps no trace of each.
            self._epochs.pop(address, None)
            self._slots.pop(address, None)
            self._admission.pop(address, None)
            self._tokens.pop(address, None)

    async def close(self) -> None:
        """Close pooled connections and stop the threads (a read still running closes its connection as it ends)."""
        self._closed = True
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
        for lane in {id(x): x for x in (self._normal, self._bulk)}.values():
            lane.copier.close()
            lane.copy_threads.close()
            lane.pool.shutdown(wait=False, cancel_futures=True)
            lane.land_pool.shutdown(wait=False, cancel_futures=True)


def _idle_key(address: str, carries: str) -> str:
    """Where a connection to ``address`` that carries these reads waits between reads."""
    return f"{address} {carries}" if carries else address


@dataclasses.dataclass(frozen=True)
class _Lane:
    """The threads that move one lane's reads: ``pool`` receives them (each
    read a thread, blocking on its socket), ``land_pool`` relays out what
    they receive for a GPU, ``copy_threads`` land host segments and copy
    same-host pieces (through ``copier``)."""

    pool: concurrent.futures.ThreadPoolExecutor
    land_pool: concurrent.futures.ThreadPoolExecutor
    copy_threads: CopyThreads
    copier: Copier

    @classmethod
    def start(cls, suffix: str, copy_threads: int, nice: int | None = None) -> _Lane:
        """A lane's threads; with ``nice``, they run at it. A pool starts
        its threads from the thread that submits, and a thread inherits its
        nice, so a niced lane's landings and copies need threads of their own
        too (and the plain lane's are never started by a niced thread)."""
        niced: dict[str, Any] = {} if nice is None else {"initializer": set_thread_nice, "initargs": (nice,)}
        copies = CopyThreads(copy_threads, nice=nice, name=f"kvd-copy{suffix}")
        return cls(concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix=f"kvd-recv{suffix}", **niced),
                   concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix=f"kvd-land{suffix}", **niced),
                   copies, Copier(pool=copies))


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
