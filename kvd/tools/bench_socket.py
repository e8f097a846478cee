"""The plain socket baselines kvd bench measures beside kvd: a sender /
receiver pair moving one request's bytes over 1..k connections (throughput,
and the CPU both ends spend), and an echo pair answering a one-byte ask with
a small request's bytes (the data part of its latency floor)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any


def _socket_receiver(port_q: Any, nbytes: int, connections: int, out_q: Any) -> None:
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(connections)
    port_q.put(srv.getsockname()[1])
    conns = [srv.accept()[0] for _ in range(connections)]
    # Receive into request-sized memory, as kvd must: reusing one small
    # buffer would keep it in cache and flatter the baseline. Connection i
    # fills share i, on a thread of its own, as kvd's data threads do.
    view = memoryview(bytearray(nbytes))
    got = [0] * connections

    def receive(i: int) -> None:
        lo, hi = _share(nbytes, connections, i)
        at = lo
        while at < hi:
            k = conns[i].recv_into(view[at : min(hi, at + (1 << 20))])
            if not k:
                break
            at += k
        got[i] = at - lo

    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=receive, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out_q.put((sum(got), time.perf_counter() - t0, time.process_time() - cpu0))


def _share(nbytes: int, parts: int, i: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of share ``i`` of ``parts``, cut on 1 MiB bounds."""
    chunks = -(-nbytes // (1 << 20))
    lo, hi = chunks * i // parts, chunks * (i + 1) // parts
    return min(nbytes, lo << 20), min(nbytes, hi << 20)


def socket_baseline(nbytes: int, repeat: int, cpu: dict[str, float] | None = None, connections: int = 1) -> float:
    """GB/s of a plain sender/receiver pair over ``connections`` TCP
    connections (a thread each end per connection, each carrying an equal
    share): sendall and recv_into, 1 MiB at a time, from and into
    request-sized buffers (distinct memory, like kvd's). ``cpu`` gets
    ``s_per_gb``: both ends' CPU seconds per GB, the least of the tries."""
    import socket
    import threading

    ctx = mp.get_context("spawn")
    best = 0.0
    payload = memoryview(bytearray(nbytes))
    for _ in range(repeat):
        port_q, out_q = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_socket_receiver, args=(port_q, nbytes, connections, out_q))
        proc.start()
        port = port_q.get(timeout=30)
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]

        def send(i: int, sock: socket.socket) -> None:
            lo, hi = _share(nbytes, connections, i)
            for off in range(lo, hi, 1 << 20):
                sock.sendall(payload[off : min(hi, off + (1 << 20))])

        cpu0 = time.process_time()
        threads = [threading.Thread(target=send, args=(i, sock)) for i, sock in enumerate(socks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sent_cpu = time.process_time() - cpu0
        got, seconds, recv_cpu = out_q.get(timeout=120)
        for sock in socks:
            sock.close()
        proc.join(timeout=30)
        best = max(best, got / seconds / 1e9)
        if cpu is not None:
            per_gb = (sent_cpu + recv_cpu) / (got / 1e9)
            cpu["s_per_gb"] = min(cpu.get("s_per_gb", per_gb), per_gb)
    return best


def best_socket(nbytes: int, repeat: int, connections: int, cpu: dict[str, float] | None = None) -> tuple[float, int]:
    """The best plain socket over 1..``connections`` connections (the most
    kvd stripes a read across): (GB/s, the connections that gave it).
    ``cpu`` gets the CPU per GB of that connection count."""
    best, used, best_cpu = 0.0, 1, float("inf")
    for k in range(1, connections + 1):
        spent: dict[str, float] = {}
        gbps = socket_baseline(nbytes, repeat, spent, k)
        if gbps > best:
            best, used, best_cpu = gbps, k, spent["s_per_gb"]
    if cpu is not None:
        cpu["s_per_gb"] = best_cpu
    return best, used


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds a process's threads have run so far, in nanoseconds (each
    thread's ``/proc/PID/task/TID/schedstat``): ``/proc/PID/stat`` counts
    10 ms ticks, coarse against a transfer of a tenth of a second. Threads
    that already exited are not counted; a daemon's data and copy threads
    live as long as it does."""

    total, read = 0, 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            read += 1
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    if not read:
        raise RuntimeError(f"no thread of process {pid} has a readable schedstat: its CPU time cannot be measured")
    return total / 1e9


def _echo_server(port_q: Any, nbytes: int) -> None:
    """Answers each one-byte request with ``nbytes``, as an owner answers a READ."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(nbytes))
    while conn.recv(1):
        conn.sendall(payload)


def socket_round_trip(nbytes: int, count: int) -> list[float]:
    """Seconds for a plain socket to ask for ``nbytes`` and receive them all,
    ``count`` times: the data part of a small request with nothing around it."""
    import socket

    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_echo_server, args=(port_q, nbytes), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", port_q.get(timeout=30)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(nbytes))
    out = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            sock.sendall(b"r")
            got = 0
            while got < nbytes:
                k = sock.recv_into(view[got:])
                if not k:
                    raise SystemExit("socket round-trip baseline: the echo server went away")
                got += k
            out.append(time.perf_counter() - t0)
    finally:
        sock.close()
        proc.join(timeout=10)
    return out
