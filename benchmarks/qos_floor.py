"""The least a bulk load can slow a small transfer on this machine, whatever
orders the wire: the floor of ``qos_small_p99_loaded_vs_unloaded``.

``kvd bench --sections qos`` times small interactive pulls (4 MiB) idle and
beside two bulk pulls over loopback TCP, with ``--qos on``: the bulk reads'
threads niced (``qos_bulk_nice``, 10) and their sends held back, a chunk
(``qos_chunk_bytes``, 1 MiB) at a time, while an interactive read moves.
This does the same with nothing but plain sockets and an ideal gate: two
processes, a small sender and two bulk senders in one and their receivers in
the other, every bulk thread at nice 10, and each bulk sender waiting before
its next 1 MiB while the small transfer is on the wire. Small transfers run
one after another idle, then at random (exponential gaps, mean 30 ms) while
both bulk streams flow; the p99 ratio printed is the floor of kvd's figure
here, and the p50 ratio says whether the whole distribution moves.
``--hold-receivers`` also holds the bulk receivers back while a small
transfer is on its way (so no bulk byte moves beside it but the chunk under
way); ``--idle-gaps`` spaces the idle transfers as the loaded ones are.

    python benchmarks/qos_floor.py [--rounds 3] [--small-mib 4] [--samples 40] [--hold-receivers] [--idle-gaps]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import threading
import time
from typing import Any

from kvd.tools.bench_pair import p50, p99  # as kvd bench --sections qos reads its samples

CHUNK = 1 << 20
BULK_SPAN = 256 << 20  # bulk bytes land across a span this big, as into a cache, not one hot buffer
BULK_NICE = 10  # qos_bulk_nice's default


def _nice(value: int) -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)


def _sender_side(ports: list[int], small_bytes: int) -> None:
    """The owner: one small sender (nice 0), two bulk senders (niced) that
    wait before each chunk while the small one is sending."""
    gate = threading.Condition()
    sending = [False]

    def small(port: int) -> None:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        src = memoryview(bytearray(b"\1" * small_bytes))
        while conn.recv(1):
            with gate:
                sending[0] = True
            conn.sendall(src)
            with gate:
                sending[0] = False
                gate.notify_all()

    def bulk(port: int) -> None:
        _nice(BULK_NICE)
        conn = socket.create_connection(("127.0.0.1", port))
        src = memoryview(bytearray(b"\2" * BULK_SPAN))
        at = 0
        try:
            while True:
                with gate:
                    while sending[0]:
                        gate.wait()
                conn.sendall(src[at:at + CHUNK])
                at = (at + CHUNK) % BULK_SPAN
        except OSError:
            return

    threads = [threading.Thread(target=small, args=(ports[0],), daemon=True)]
    threads += [threading.Thread(target=bulk, args=(p,), daemon=True) for p in ports[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _Hold:
    """Set while a small transfer is on its way: bulk receivers wait (``--hold-receivers``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.on = False

    def set(self, on: bool) -> None:
        with self.cond:
            self.on = on
            self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            while self.on:
                self.cond.wait()


def _bulk_receiver(conn: socket.socket, stop: threading.Event, hold: _Hold) -> None:
    _nice(BULK_NICE)
    dst = memoryview(bytearray(BULK_SPAN))
    at = 0
    while not stop.is_set():
        hold.wait()
        n = conn.recv_into(dst[at:at + CHUNK])
        if not n:
            return
        at = (at + n) % (BULK_SPAN - CHUNK)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small-mib", type=int, default=4)
    ap.add_argument("--samples", type=int, default=40, help="small transfers idle, and as many under the bulk load")
    ap.add_argument("--hold-receivers", action="store_true", help="bulk receivers wait while a small transfer is on its way")
    ap.add_argument("--idle-gaps", action="store_true", help="idle transfers spaced as the loaded ones (exponential, mean 30 ms)")
    args = ap.parse_args()
    small_bytes = args.small_mib << 20
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    owner = mp.Process(target=_sender_side, args=([s.getsockname()[1] for s in listeners], small_bytes), daemon=True)
    owner.start()
    conns = [s.accept()[0] for s in listeners]
    small = conns[0]
    small.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dst = memoryview(bytearray(small_bytes))
    hold, holding = _Hold(), args.hold_receivers

    def one() -> float:
        t0 = time.perf_counter()
        hold.set(holding)
        small.send(b"g")
        got = 0
        while got < small_bytes:
            got += small.recv_into(dst[got:])
        hold.set(False)
        return time.perf_counter() - t0

    def spaced() -> float:
        time.sleep(rng.expovariate(1 / 0.03))
        return one()

    rng = random.Random(0)
    for _ in range(5):
        one()
    print(f"qos floor: {args.small_mib} MiB over loopback, idle vs beside two bulk streams (nice {BULK_NICE}, held back while it sends)")
    rows: list[dict[str, Any]] = []
    try:
        for k in range(args.rounds):
            idle = [spaced() if args.idle_gaps else one() for _ in range(args.samples)]
            stop = threading.Event()
            # The bulk senders block on full sockets until these receive.
            receivers = [threading.Thread(target=_bulk_receiver, args=(c, stop, hold), daemon=True) for c in conns[1:]]
            for r in receivers:
                r.start()
            time.sleep(0.3)
            loaded: list[float] = []
            for _ in range(args.samples):
                loaded.append(spaced())
            stop.set()
            for r in receivers:
                r.join()
            rows.append({"p50": p50(loaded) / p50(idle), "p99": p99(loaded) / p99(idle)})
            print(f"  round {k + 1}: idle p50 {p50(idle) * 1e3:.2f} p99 {p99(idle) * 1e3:.2f} ms; under bulk p50 {p50(loaded) * 1e3:.2f} "
                  f"p99 {p99(loaded) * 1e3:.2f} ms; loaded / idle: p50 {rows[-1]['p50']:.2f}, p99 {rows[-1]['p99']:.2f}", flush=True)
            time.sleep(0.2)
    finally:
        owner.kill()
    p99s, p50s = (" ".join(f"{r[q]:.2f}" for r in rows) for q in ("p99", "p50"))
    print(f"floor of qos_small_p99_loaded_vs_unloaded here: each round {p99s}; p50 moved {p50s}")


if __name__ == "__main__":
    main()
