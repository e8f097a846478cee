"""Data-plane bounds: a stalled reader cannot grow the sender's memory, and
connection caps hold."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.core import errors
from kvd.core.wire import FrameType
from kvd.proto import kvd_pb2 as pb
from kvd.tools.bench_load import proc_status_bytes
from kvd.transport.tcp_server import TcpDataServer
from tests.conftest import make_worker
from tests.rawpeer import RawPeer, fake_engine, handshake

BIG = dict(layers=8, heads=4, head_size=128, num_blocks=1024)  # 256 MiB of cache


def rss(pid: int) -> int:
    return proc_status_bytes(pid, "VmRSS")


def test_stalled_reader_keeps_the_senders_memory_bounded(daemons):
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill", **BIG)
    token = handshake(p.grpc, fake_engine("reader", layers=8, heads=4, head_size=128)).data_token
    ids = list(range(1, 1001))
    params = pw.client.publish("r", [ids], len(ids) * 16)
    before = rss(p.proc.pid)
    raw = RawPeer(p.info["data"])
    assert raw.hello("reader", "e1", token)[0] is FrameType.HELLO_OK
    read = pb.DataRead(owner_engine_id="prefill", request_id="r", generation=params.generation, capability=params.capability,
                       head_start=0, head_count=4)
    for b in range(1, 1001, 10):  # 100 gathered segments of 10 blocks x 8 layers x K+V: 250 MiB asked for
        read.segments.add(group_id=0, layers=list(range(8)), block_start=b, block_count=10, token_start=0, token_count=16)
    raw.send(FrameType.READ, read.SerializeToString())
    time.sleep(3)  # never read a byte
    grown = rss(p.proc.pid) - before
    assert grown < 48 << 20, f"sender grew {grown >> 20} MiB for a stalled reader"
    raw.close()
    with grpc.insecure_channel(p.grpc) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def _hello_ok(raw_address: str, engine: str, epoch: str, token: bytes, seconds: float = 5.0) -> RawPeer:
    """A connection whose HELLO is accepted, retried while the owner catches
    up (a closed connection's slot is released on its loop, after the close)."""
    deadline = time.monotonic() + seconds
    while True:
        raw = RawPeer(raw_address)
        ftype, body = raw.hello(engine, epoch, token)
        if ftype is FrameType.HELLO_OK or time.monotonic() > deadline:
            assert ftype is FrameType.HELLO_OK, (ftype, body)
            return raw
        raw.close()
        time.sleep(0.05)


def test_connections_per_reader_are_capped(daemons):
    """16 data connections an engine, counted over its epochs; another engine
    is not refused for it, and a closed connection gives its slot back."""
    p = daemons.start("prefill")
    make_worker(p.grpc, "prefill")
    token = handshake(p.grpc, fake_engine("reader")).data_token
    peers = []
    for _ in range(8):
        raw = RawPeer(p.info["data"])
        assert raw.hello("reader", "e1", token)[0] is FrameType.HELLO_OK
        peers.append(raw)
    # The same engine restarted (a new epoch) while its old connections linger: they still count.
    token2 = handshake(p.grpc, fake_engine("reader", epoch="e2")).data_token
    for _ in range(8):
        raw = RawPeer(p.info["data"])
        assert raw.hello("reader", "e2", token2)[0] is FrameType.HELLO_OK
        peers.append(raw)
    extra = RawPeer(p.info["data"])
    ftype, body = extra.hello("reader", "e2", token2)
    assert ftype is FrameType.ERROR and b"RESOURCE_EXHAUSTED" in body and b"'reader'" in body and b"16 data connections" in body, body
    extra.close()
    # Another engine's reads are not refused for this one's.
    other_token = handshake(p.grpc, fake_engine("other")).data_token
    other = RawPeer(p.info["data"])
    assert other.hello("other", "e1", other_token)[0] is FrameType.HELLO_OK
    # One of the old epoch's connections closes: its slot comes back, and only one.
    peers.pop(0).close()
    peers.append(_hello_ok(p.info["data"], "reader", "e2", token2))
    extra = RawPeer(p.info["data"])
    assert extra.hello("reader", "e2", token2)[0] is FrameType.ERROR
    extra.close()
    for raw in [*peers, other]:
        raw.close()
    # Every slot comes back once its connection is gone.
    peers = [_hello_ok(p.info["data"], "reader", "e2", token2) for _ in range(16)]
    for raw in peers:
        raw.close()


def test_a_connection_that_outlives_the_event_loop_ends_quietly(caplog):
    """A data connection's thread that reaches its HELLO after the daemon's
    loop has closed (shutdown waits 5 s for such threads, then goes on) closes
    the connection as a shutdown, not as a failure with a traceback. Control:
    the same HELLO while the loop runs is answered."""

    class Refuses:  # the daemon's side of a HELLO: always refused, so the control needs no handshake
        def check_hello(self, hello):
            raise errors.PermissionDenied(f"engine {hello.engine_id!r} is not known here")

    def started(loop: asyncio.AbstractEventLoop) -> TcpDataServer:
        srv = TcpDataServer(Refuses(), "127.0.0.1", 0)  # type: ignore[arg-type]
        loop.run_until_complete(srv.start())
        return srv

    def hello_on(loop: asyncio.AbstractEventLoop, raw: RawPeer) -> FrameType:
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(raw.hello("reader", "e1")), daemon=True)
        t.start()
        while t.is_alive():  # the server's accept and its HELLO check run on this loop
            loop.run_until_complete(asyncio.sleep(0.01))
        return answer[0][0]

    loop = asyncio.new_event_loop()
    srv = started(loop)
    raw = RawPeer(f"127.0.0.1:{srv.port}")
    assert hello_on(loop, raw) is FrameType.ERROR  # control: a live loop answers
    raw.close()

    late = RawPeer(f"127.0.0.1:{srv.port}")
    while not srv._conns:  # accepted: its thread waits for the HELLO
        loop.run_until_complete(asyncio.sleep(0.01))
    assert srv._accept is not None
    srv._accept.cancel()  # as close() does first
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()  # the daemon went on without this thread
    with caplog.at_level(logging.WARNING, logger="kvd.tcp"):
        with pytest.raises(ConnectionError):
            late.hello("reader", "e1")  # closed, unanswered
        deadline = time.monotonic() + 5
        while srv._threads and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not srv._threads, "the connection's thread is still running"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    late.close()


def test_a_hello_the_loop_is_too_busy_to_answer_is_refused_and_takes_no_slot():
    """The HELLO's calls into the daemon's loop wait at most the HELLO
    timeout: past it the connection is closed, and the call it gave up on
    never runs later, so the reader's connection slot is not taken by a
    connection that no longer exists (the daemon's watchdog logs the stall)."""

    class StallsAfter:  # accepts, then keeps the loop busy past the HELLO timeout before the slot is taken
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        def check_hello(self, hello):
            self.loop.call_soon(time.sleep, 1.5)

    loop = asyncio.new_event_loop()
    srv = TcpDataServer(StallsAfter(loop), "127.0.0.1", 0, hello_timeout_s=0.5)  # type: ignore[arg-type]
    loop.run_until_complete(srv.start())
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        raw = RawPeer(f"127.0.0.1:{srv.port}")
        with pytest.raises(ConnectionError):
            raw.hello("reader", "e1")  # closed, unanswered
        raw.close()
        time.sleep(1.5)  # the stall ends; the abandoned call would run now
        assert asyncio.run_coroutine_threadsafe(_readers_of(srv), loop).result(5) == set()
    finally:
        asyncio.run_coroutine_threadsafe(srv.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


async def _readers_of(srv: TcpDataServer) -> set[tuple[str, str]]:
    return srv.connected_readers()
