"""What reading the finished sets costs an engine step: a GetFinished round
trip (what KvdConnector did on every step) against ``FinishedFeed.take`` (what
it does now: the daemon pushes, a background thread gathers).

One daemon (started here unless ``--address`` names a running one), one
registered worker with a tiny CPU cache, nothing transferring: the idle
per-step cost, as under ``vllm bench serve`` with no P/D traffic. Prints the
median and p99 of each call in microseconds.

    python benchmarks/finished_poll.py [--n 2000] [--address HOST:PORT --engine-id ID]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvd.caches import allocate_kv_caches, release_all
from kvd.client import FinishedFeed, KvdClient
from kvd.spec import KVCacheSpec, ModelInfo, WorkerId, parse_layout
from kvd.testing.daemons import DaemonDidNotStart, start_daemon


def _start_daemon(engine_id: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    d = start_daemon(engine_id, tmp, "--metrics-port", "-1")
    try:
        return d.proc, d.grpc
    except DaemonDidNotStart as e:
        raise SystemExit(str(e)) from None


def _time_calls(call: Callable[[], object], n: int) -> list[float]:
    """Microseconds per call, each timed alone (as one engine step would see it)."""
    for _ in range(min(n, 100)):  # warm the channel and the caches
        call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def _summary(name: str, us: list[float]) -> str:
    us = sorted(us)
    p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
    return f"{name:<26} n={len(us)}  median={statistics.median(us):9.1f} us  p99={p99:9.1f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="calls per method")
    ap.add_argument("--address", default="", help="a running daemon's gRPC address (default: start one)")
    ap.add_argument("--engine-id", default="bench-poll", help="that daemon's engine id")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = (None, args.address) if args.address else _start_daemon(args.engine_id, Path(tmp))
        worker = WorkerId(args.engine_id, 0, 1, 0, 1)
        client = KvdClient(address, worker)
        feed: FinishedFeed | None = None
        try:
            client.wait_ready()
            spec = KVCacheSpec(16, 4, 16, "bfloat16", parse_layout("NHD"), 64)
            client.register(allocate_kv_caches(spec, [f"model.layers.{i}.self_attn.attn" for i in range(4)]), ModelInfo(4, 4), spec)
            old = _time_calls(client.get_finished, args.n)
            feed = FinishedFeed(client).start()
            if not feed.subscribed.wait(10):
                raise SystemExit(f"the feed did not subscribe: {feed.error}")
            new = _time_calls(feed.take, args.n)
            print(_summary("get_finished (GetFinished)", old))
            print(_summary("feed.take (WatchFinished)", new))
            print(f"median ratio: {statistics.median(old) / statistics.median(new):.0f}x")
        finally:
            if feed is not None:
                feed.close()
            client.unregister()
            client.close()
            release_all()
            if proc is not None:
                proc.terminate()
                proc.wait(30)


if __name__ == "__main__":
    main()
