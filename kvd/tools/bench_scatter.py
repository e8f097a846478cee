"""``kvd bench``'s floor for small units: a plain sender and receiver that
move the same pieces kvd's TCP path moves, with nothing around them.

kvd's TCP path sends a batch of scattered blocks straight from registered
memory and receives it straight into place: one ``sendmsg`` and one
``recvmsg`` per up to 1024 pieces, a piece per layer, K or V, and block.
This baseline does only that, in two processes, between two shared-memory
regions, each side's pieces in its own random order (as the bench's block
ids are): how fast the kernel moves pieces of that size on this machine.
Its 16 KiB / 1 MiB ratio says how much of ``tcp_16k_vs_1m`` is kvd's and how
much is the kernel's own cost per piece (each iovec entry is a separate
user copy on both sides, however the pieces lie).
"""

from __future__ import annotations

import mmap
import random
import socket
import tempfile
import time
from typing import Any

import numpy as np

from kvd.core.iov import make
from kvd.transport.iovec import recv_all, send_all


def _region(nbytes: int) -> tuple[mmap.mmap, int]:
    """Shared memory as a worker registers it, every page touched."""
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        f.truncate(nbytes)
        m = mmap.mmap(f.fileno(), nbytes)
    m.write(b"\x01" * nbytes)
    return m, np.frombuffer(m, np.uint8).ctypes.data


def _scattered(base: int, nbytes: int, piece: int, seed: int) -> np.ndarray:
    order = np.arange(nbytes // piece, dtype=np.uint64)
    np.random.default_rng(seed).shuffle(order)
    return make(base + order * np.uint64(piece), piece)


def _receiver(port_q: Any, nbytes: int, piece: int, seed: int, out_q: Any) -> None:
    region, base = _region(nbytes)
    iov = _scattered(base, nbytes, piece, seed)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    t0 = time.perf_counter()
    got = recv_all(conn, iov)
    out_q.put((got, time.perf_counter() - t0))
    conn.close()
    region.close()


class ScatteredSocket:
    """One try moves ``nbytes`` in pieces of ``piece`` bytes; returns GB/s."""

    def __init__(self, nbytes: int, piece: int) -> None:
        self.nbytes, self.piece = nbytes - nbytes % piece, piece
        self._region, self._base = _region(self.nbytes)
        self._rng = random.Random(piece)

    def one_try(self) -> float:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port_q, out_q = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_receiver, args=(port_q, self.nbytes, self.piece, self._rng.randrange(1 << 30), out_q))
        proc.start()
        try:
            sock = socket.create_connection(("127.0.0.1", port_q.get(timeout=60)))
            with sock:
                send_all(sock, _scattered(self._base, self.nbytes, self.piece, self._rng.randrange(1 << 30)))
                got, seconds = out_q.get(timeout=120)
        finally:
            proc.join(timeout=30)
        if got != self.nbytes:
            raise SystemExit(f"scattered socket baseline: received {got} of {self.nbytes} bytes")
        return got / seconds / 1e9

    def close(self) -> None:
        self._region.close()
