"""``kvd bench --sections load``: the daemons' memory under a long load.

Two real daemons move requests of mixed sizes (1 to 1024 scattered blocks
of 64 KiB a layer, 4 layers) one after another for ``--load-seconds``,
while their anonymous RSS (``RssAnon``: the daemon's own memory; the
registered caches it maps are the workers' shared memory and not counted)
is sampled. The figure is the growth from the end of the warm-up to the end,
as a fraction of the warm RSS, for the daemon that grew most. The warm-up
is as long as a daemon keeps a record of a finished pull (2 x
``pull_timeout_seconds``, 120 s; half of a shorter run): pools, caches and
connections fill there, and time-bounded records reach their steady count.
A daemon that keeps something per request or per byte shows it here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec
from kvd.daemon.config import DaemonConfig
from kvd.tools.bench_pair import BenchPair

LAYERS = 4
BLOCKS = 1024  # per cache: 1024 blocks x 4 layers x 64 KiB = 256 MiB a side
SIZES = (1, 16, 128, 1024)  # blocks of one request, drawn uniformly


def proc_status_bytes(pid: int, field: str) -> int:
    """A memory figure of ``/proc/PID/status`` (``RssAnon``, ``VmRSS``, ...), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def rss_anon_bytes(pid: int) -> int:
    return proc_status_bytes(pid, "RssAnon")


def bench_load(seconds: float, say: Callable[[str], None]) -> dict[str, Any]:
    if not seconds > 0:
        raise SystemExit(f"kvd bench: --load-seconds={seconds:g} must be positive")
    say(f"load: requests of {'/'.join(map(str, SIZES))} scattered 64 KiB blocks x {LAYERS} layers, one after another, for {seconds:g} s")
    rng = random.Random(0)
    pair = BenchPair("tcp")
    try:
        pair.register(KVCacheSpec(16, 8, 128, "bfloat16", NAMED_LAYOUTS["NHD"], BLOCKS + 1), LAYERS)
        pids = {"P": pair.daemons.procs[0].pid, "D": pair.daemons.procs[1].pid}
        block_bytes = 16 * 4096 * LAYERS
        start = time.monotonic()
        warm_at, next_sample = start + min(seconds / 2, 2 * DaemonConfig("load").pull_timeout_seconds), start
        warm: dict[str, int] = {}
        samples: list[tuple[float, dict[str, int]]] = []
        moved = requests = moved_warm = 0
        while time.monotonic() < start + seconds:
            n = rng.choice(SIZES)
            pair.transfer(f"load-{requests}", rng.sample(range(1, BLOCKS + 1), n), rng.sample(range(1, BLOCKS + 1), n), n * 16)
            moved += n * block_bytes
            requests += 1
            now = time.monotonic()
            if now >= next_sample:
                rss = {side: rss_anon_bytes(pid) for side, pid in pids.items()}
                samples.append((now - start, rss))
                if not warm and now >= warm_at:
                    warm = rss
                    moved_warm = moved
                next_sample = now + max(1.0, seconds / 30)
                if len(samples) % 5 == 1:
                    say(f"  {now - start:6.0f} s  {requests} requests, {moved / 1e9:.1f} GB moved, RssAnon "
                        + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in rss.items()))
        end = {side: rss_anon_bytes(pid) for side, pid in pids.items()}
    finally:
        pair.close()
    if not warm:  # a run shorter than one sample interval past the warm-up
        warm, moved_warm = samples[0][1], 0
    growth = {side: (end[side] - warm[side]) / warm[side] for side in end}
    after_gb = (moved - moved_warm) / 1e9
    out: dict[str, Any] = {
        "load_seconds": seconds,
        "load_requests": requests,
        "load_gb_moved": moved / 1e9,
        "load_rss_warm_mib": {k: v / 2**20 for k, v in warm.items()},
        "load_rss_end_mib": {k: v / 2**20 for k, v in end.items()},
        "load_rss_peak_mib": {k: max(s[k] for _, s in [*samples, (0.0, end)]) / 2**20 for k in end},
        "load_rss_growth": max(growth.values()),
        # (seconds, {daemon: MiB}) through the run: flat after the warm-up, or not
        "load_rss_samples": [(round(t, 1), {k: round(v / 2**20, 1) for k, v in rss.items()}) for t, rss in samples],
        "load_rss_mib_per_gb": max((end[k] - warm[k]) / 2**20 for k in end) / after_gb if after_gb > 0 else 0.0,
    }
    for side in end:
        say(f"  {side}: RssAnon {out['load_rss_warm_mib'][side]:.0f} MiB after warm-up, {out['load_rss_end_mib'][side]:.0f} at the end "
            f"(peak {out['load_rss_peak_mib'][side]:.0f}), growth {growth[side]:+.1%}")
    say(f"  {requests} requests, {moved / 1e9:.1f} GB moved; worst growth {out['load_rss_growth']:+.1%} "
        f"({out['load_rss_mib_per_gb']:+.2f} MiB per GB moved after the warm-up)")
    return out
