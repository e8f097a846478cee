"""How fast can any sender move scattered blocks over one loopback TCP stream?

The floor under ``kvd bench``'s ``tcp_16k_vs_1m``: two processes, no framing,
no Python per block, just ``sendmsg``/``recvmsg`` (MSG_WAITALL) over iovec
lists of randomly ordered pieces of a 256 MiB buffer, 32 MiB per call as
kvd's in-place frames are. Tries of the piece sizes alternate, so a slow
spell of the machine falls on each. It prints GB/s per piece size (best of
the tries) and the 16 KiB / 1 MiB ratio the kernel alone allows; compare it
with kvd's in a run of ``kvd bench`` on the same machine.

    python benchmarks/scattered_socket.py [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import time

import numpy as np

from kvd.transport import iovec

UNITS = {"16k": 16 << 10, "64k": 64 << 10, "1m": 1 << 20}
SEGMENT = 32 << 20  # kvd's in_place_segment_bytes


def _pieces(buf: np.ndarray, unit: int, seed: int) -> np.ndarray:
    order = list(range(len(buf) // unit))
    random.Random(seed).shuffle(order)
    return iovec.make(buf.ctypes.data + np.array(order, dtype=np.uint64) * unit, unit)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)  # as kvd's data plane


def _segments(iov: np.ndarray, unit: int) -> list[np.ndarray]:
    step = max(1, SEGMENT // unit)
    return [iov[i:i + step] for i in range(0, len(iov), step)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    nbytes = args.mib << 20
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    if os.fork() == 0:  # the sender
        conn = socket.create_connection(("127.0.0.1", port))
        _tune(conn)
        src = np.ones(nbytes, dtype=np.uint8)
        for r in range(args.repeat):
            for unit in UNITS.values():
                conn.recv(1)
                for seg in _segments(_pieces(src, unit, r), unit):
                    iovec.send_all(conn, seg)
        os._exit(0)
    conn, _ = srv.accept()
    _tune(conn)
    dst = np.zeros(nbytes, dtype=np.uint8)
    dst[::4096] = 1  # fault the pages in before timing
    best: dict[str, float] = {}
    for r in range(args.repeat):
        for label, unit in UNITS.items():
            segs = _segments(_pieces(dst, unit, 1000 + r), unit)
            t0 = time.perf_counter()
            conn.send(b"g")
            for seg in segs:
                iovec.recv_all(conn, seg)
            best[label] = max(best.get(label, 0.0), nbytes / (time.perf_counter() - t0) / 1e9)
    os.wait()
    for label in UNITS:
        print(f"scattered {label:>3} pieces, sendmsg/recvmsg   {best[label]:6.2f} GB/s")
    print(f"16k / 1m ratio the kernel allows: {best['16k'] / best['1m']:.2f}")


if __name__ == "__main__":
    main()
