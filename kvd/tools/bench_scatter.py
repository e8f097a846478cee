"""``kvd bench``'s floor for small units: a plain sender and receiver that
move the same pieces kvd's TCP path moves, with nothing around them.

kvd's TCP path sends a batch of scattered blocks straight from registered
memory and receives it straight into place: one ``sendmsg`` and one
``recvmsg`` per up to 1024 pieces, a piece per layer, K or V, and block.
This baseline does only that, in two processes, between two shared-memory
regions, each side's pieces in its own random order (as the bench's block
ids are), over as many connections as kvd stripes a big read across (each
moving its share of the pieces on its own thread): how fast the kernel
moves pieces of that size on this machine.
Its 16 KiB / 1 MiB ratio says how much of ``tcp_16k_vs_1m`` is kvd's and how
much is the kernel's own cost per piece (each iovec entry is a separate
user copy on both sides, however the pieces lie).
"""

from __future__ import annotations

import mmap
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.core.iov import make
from kvd.transport.iovec import recv_all, send_all


def region(nbytes: int) -> tuple[mmap.mmap, int]:
    """Shared memory as a worker registers it, every page touched."""
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        f.truncate(nbytes)
        m = mmap.mmap(f.fileno(), nbytes)
    m.write(b"\x01" * nbytes)
    return m, np.frombuffer(m, np.uint8).ctypes.data


def scattered(base: int, nbytes: int, piece: int, seed: int) -> np.ndarray:
    order = np.arange(nbytes // piece, dtype=np.uint64)
    np.random.default_rng(seed).shuffle(order)
    return make(base + order * np.uint64(piece), piece)


def _share(iov: np.ndarray, i: int, streams: int) -> np.ndarray:
    per = -(-len(iov) // streams)
    return iov[i * per : (i + 1) * per]


def _each_on_its_thread(socks: list[socket.socket], iov: np.ndarray, move: Callable[[socket.socket, np.ndarray], int]) -> int:
    """``move`` each connection's share of ``iov`` on its own thread; total bytes."""
    moved = [0] * len(socks)

    def one(i: int) -> None:
        moved[i] = move(socks[i], _share(iov, i, len(socks)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(socks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(moved)


def _receiver(port_q: Any, nbytes: int, piece: int, streams: int, seed: int, out_q: Any) -> None:
    mem, base = region(nbytes)
    iov = scattered(base, nbytes, piece, seed)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(streams)
    port_q.put(srv.getsockname()[1])
    conns = [srv.accept()[0] for _ in range(streams)]
    t0 = time.perf_counter()
    got = _each_on_its_thread(conns, iov, recv_all)
    out_q.put((got, time.perf_counter() - t0))
    for c in conns:
        c.close()
    mem.close()


class ScatteredSocket:
    """One try moves ``nbytes`` in pieces of ``piece`` bytes over ``streams``
    connections; returns GB/s."""

    def __init__(self, nbytes: int, piece: int, streams: int) -> None:
        self.nbytes, self.piece, self.streams = nbytes - nbytes % piece, piece, streams
        self._region, self._base = region(self.nbytes)
        self._rng = random.Random(piece)

    def one_try(self) -> float:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port_q, out_q = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_receiver, args=(port_q, self.nbytes, self.piece, self.streams, self._rng.randrange(1 << 30), out_q))
        proc.start()
        try:
            port = port_q.get(timeout=60)
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(self.streams)]
            try:
                _each_on_its_thread(socks, scattered(self._base, self.nbytes, self.piece, self._rng.randrange(1 << 30)), send_all)
                got, seconds = out_q.get(timeout=120)
            finally:
                for sock in socks:
                    sock.close()
        finally:
            proc.join(timeout=30)
        if got != self.nbytes:
            raise SystemExit(f"scattered socket baseline: received {got} of {self.nbytes} bytes")
        return got / seconds / 1e9

    def close(self) -> None:
        self._region.close()
