"""The least a streamed transfer can add to TTFT beside a prefill that keeps
every core busy, on this machine, whatever moves the bytes.

``kvd bench --sections stream`` judges streamed against pulled: what a
transfer overlapped with the prefill adds to it, over what the same
transfer adds after it. This moves the same bytes with nothing but a plain
loopback socket (two bare processes, ``sendall`` and ``recv_into`` of 1 MiB)
in turn: alone (pulled's floor) and beside the stream bench's own busy
prefill (``demo_worker.Burner``: matrix products on torch's threads, one a
core), timing how much longer that compute takes. Where the cores are all
busy, the transfer's CPU comes out of the compute's, so overlapping it hides
nothing; the ratio printed is the floor of ``stream_vs_pull_*`` here.

    python benchmarks/stream_floor.py [--mib 1024 8] [--compute-s 3.0 0.1] [--tries 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

CHUNK = 1 << 20


def _receiver(port_q: Any) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_q.put(server.getsockname()[1])
    buf = memoryview(bytearray(CHUNK))
    while True:
        conn, _ = server.accept()
        with conn:
            nbytes = int.from_bytes(conn.recv(8), "little")
            got = 0
            while got < nbytes and (n := conn.recv_into(buf)):
                got += n
            conn.sendall(b"k")


def _sender(port: int, orders: Any, done: Any) -> None:
    data = bytes(CHUNK)
    while (nbytes := orders.get()) is not None:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(nbytes.to_bytes(8, "little"))
            for _ in range(nbytes // CHUNK):
                conn.sendall(data)
            conn.recv(1)
        done.put(time.monotonic() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, nargs="+", default=[1024, 8], help="bytes moved, as the stream bench's 32k and 256 tokens do")
    p.add_argument("--compute-s", type=float, nargs="+", default=[3.0, 0.1], help="the busy compute, per size: longer than the transfer")
    p.add_argument("--tries", type=int, default=5)
    args = p.parse_args()

    import torch

    from kvd.tools.demo_worker import Burner

    ctx = mp.get_context("spawn")
    port_q, orders, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(port_q,), daemon=True)]
    procs[0].start()
    procs.append(ctx.Process(target=_sender, args=(port_q.get(), orders, done), daemon=True))
    procs[1].start()
    torch.set_num_threads(os.cpu_count() or 1)
    burner = Burner()
    try:
        for mib, compute_s in zip(args.mib, args.compute_s, strict=True):
            alone, beside, transfer = [], [], []
            for _ in range(args.tries):  # in turn: a slow spell falls on all three
                t0 = time.monotonic()
                burner.run(compute_s)
                alone.append(time.monotonic() - t0)
                orders.put(mib * CHUNK)
                transfer.append(done.get())
                orders.put(mib * CHUNK)
                t0 = time.monotonic()
                burner.run(compute_s)
                beside.append(time.monotonic() - t0)
                if done.get() > beside[-1]:
                    raise SystemExit(f"{mib} MiB outlasted the compute: give --compute-s more than {compute_s:g}")
            a, b, x = (statistics.median(v) for v in (alone, beside, transfer))
            print(f"{mib} MiB over a bare socket: alone {x * 1e3:.1f} ms; beside a busy {a * 1e3:.0f} ms compute it makes the compute "
                  f"{(b - a) * 1e3:.1f} ms longer: floor of streamed / pulled {(b - a) / x:.2f} (medians of {args.tries})")
    finally:
        orders.put(None)
        for proc in procs:
            proc.terminate()


if __name__ == "__main__":
    main()
