"""``kvd bench``'s second floor for the small request: kvd's process chain
with none of kvd in it.

The small request's floor (``small_request_floor_ms``) is one gRPC round
trip plus one plain socket round trip carrying the request's bytes: what
the request would cost if the worker fetched the bytes itself. kvd's shape
has hops that floor lacks: the worker asks its daemon, the daemon asks the
owner's daemon, the bytes land on a daemon thread, and the finished set
travels back on a stream that a thread of the worker reads.

This skeleton keeps that shape and nothing else. The worker's Pull reaches
its daemon over gRPC on a Unix socket (grpc.aio on uvloop, as ``kvd serve``
and the bench's workers), and the
daemon's loop sends a one-byte READ to the owner's process. The owner
sends the request's pieces straight from shared memory (one ``sendmsg``,
kvd's iovec call), and a daemon thread receives them straight into shared
memory (one ``recvmsg``). The loop then pushes the request id on a server
stream, and the worker's reader thread wakes the caller. There is no
planning, checking, leasing, framing or counting.

So its latency over the floor is what the shape itself costs on this
machine, and kvd's latency over the skeleton is what kvd's own work costs.
"""

from __future__ import annotations

import asyncio
import mmap
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
from typing import Any

import numpy as np

from kvd.tools.bench_scatter import region, scattered
from kvd.transport.framing import tune
from kvd.transport.iovec import recv_all, send_all


def _pieces(piece: int, pieces: int, seed: int) -> tuple[mmap.mmap, np.ndarray]:
    """A shared-memory region and ``pieces`` of its slots, scattered over
    twice their size in random order (as a request's blocks lie)."""
    mem, base = region(2 * piece * pieces)
    return mem, scattered(base, 2 * piece * pieces, piece, seed)[:pieces]


def _owner(port_q: Any, piece: int, pieces: int) -> None:
    """Answers each one-byte READ with every piece (the owner's daemon)."""
    mem, iov = _pieces(piece, pieces, 1)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    tune(conn)
    while conn.recv(1):
        send_all(conn, iov)
    mem.close()


def _reader(ready_q: Any, owner_port: int, worker_socket: str, piece: int, pieces: int) -> None:
    """The reading daemon: Pull in, READ out, pieces in on a thread, id pushed."""
    import grpc
    import uvloop

    mem, iov = _pieces(piece, pieces, 2)
    data = socket.create_connection(("127.0.0.1", owner_port))
    tune(data)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Queue[bytes] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def run(rid: bytes) -> None:
            data.send(b"r")
            await loop.run_in_executor(None, recv_all, data, iov)
            done.put_nowait(rid)

        async def pull(rid: bytes, context: Any) -> bytes:
            task = asyncio.create_task(run(rid))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return b""

        async def watch(_: bytes, context: Any) -> Any:
            while True:
                yield await done.get()

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("skeleton", {
            "Pull": grpc.unary_unary_rpc_method_handler(pull), "Watch": grpc.unary_stream_rpc_method_handler(watch)}),))
        server.add_insecure_port(f"unix:{worker_socket}")
        await server.start()
        ready_q.put(True)
        await server.wait_for_termination()

    try:
        uvloop.run(serve())
    finally:
        mem.close()


class SkeletonPull:
    """The owner and the reading daemon as two processes; ``one`` times one
    request from the worker's Pull to its id arriving on the stream."""

    def __init__(self, piece: int, pieces: int) -> None:
        import grpc

        ctx = mp.get_context("spawn")
        port_q = ctx.Queue()
        self._procs = [ctx.Process(target=_owner, args=(port_q, piece, pieces), daemon=True)]
        self._procs[0].start()
        owner_port = port_q.get(timeout=60)
        self._tmp = tempfile.TemporaryDirectory(prefix="kvd-skeleton-")
        worker_socket = os.path.join(self._tmp.name, "d.sock")
        self._procs.append(ctx.Process(target=_reader, args=(port_q, owner_port, worker_socket, piece, pieces), daemon=True))
        self._procs[1].start()
        port_q.get(timeout=60)
        self._channel = grpc.insecure_channel(f"unix:{worker_socket}")
        self._pull = self._channel.unary_unary("/skeleton/Pull")
        self._stream = self._channel.unary_stream("/skeleton/Watch")(b"")
        self._done: dict[bytes, float] = {}
        self._cv = threading.Condition()
        self._watch = threading.Thread(target=self._consume, daemon=True)
        self._watch.start()
        self._n = 0

    def _consume(self) -> None:
        import grpc

        try:
            for rid in self._stream:
                with self._cv:
                    self._done[rid] = time.perf_counter()
                    self._cv.notify_all()
        except grpc.RpcError:
            pass  # closed

    def one(self) -> float:
        rid = str(self._n).encode()
        self._n += 1
        t0 = time.perf_counter()
        self._pull(rid, timeout=30)
        with self._cv:
            if not self._cv.wait_for(lambda: rid in self._done, timeout=30):
                raise SystemExit("small-request skeleton: a request did not finish")
            return self._done.pop(rid) - t0

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()
        for p in self._procs:
            p.terminate()
            p.join(timeout=10)
        self._tmp.cleanup()
