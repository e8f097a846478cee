"""``kvd bench --sections verify``: what end-to-end verification costs.

Three pairs of real daemons per path (``--verify off``, ``sampled``,
``full``), moving the transport section's request (1 MiB units) in tries
that alternate. Reported, per path (TCP and same-host):

* the sampled check's cost: the time it adds to each request (the owner's
  digest before it publishes, and the reader's check after its bytes
  landed, from the daemons' own histograms) over the request's transfer
  time; beside it the throughput of the alternated tries, sampled / off;
* full mode's CPU per GB (both daemons and the workers, publish to landed,
  the median of the tries) over the same with verification off;
* that ratio's floor on this machine: a digest must read every byte on
  each side at least once, so full mode costs at least two read passes
  (a one-thread int64 sum over the same bytes, timed in the same round)
  more than off; and beside it the floor of the hash kvd has (no compiled
  code of its own): two passes of numpy's uint64 dot with keys, the
  multilinear hash's one step, over the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvd.tools.bench_pair import BenchPair

MODES = ("off", "sampled", "full")


def _pass_seconds_per_gb(nbytes: int, tries: int) -> tuple[float, float]:
    """The fastest one-thread pass over ``nbytes`` that only reads them (an
    int64 sum: the least any digest of every byte costs a side), and the
    fastest that hashes them as the digest does (256-byte rows, each dotted
    with 32 uint64 keys: numpy's dot, the digest's own step)."""
    buf = torch.empty(nbytes // 8, dtype=torch.int64).fill_(3)
    rows = buf.numpy().view(np.uint64).reshape(-1, 32)
    keys = np.arange(32, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    read = hashed = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        buf.sum()
        t1 = time.perf_counter()
        rows.dot(keys)
        read, hashed = min(read, t1 - t0), min(hashed, time.perf_counter() - t1)
    return read / (nbytes / 1e9), hashed / (nbytes / 1e9)


def _verify_seconds(pair: BenchPair) -> tuple[float, float]:
    """(sum, count) so far of the owner's digests and the reader's checks, together."""
    from kvd.testing.metrics import histogram_sums

    digest = histogram_sums(f"http://{pair.p['metrics']}/metrics", "kvd_verify_digest_seconds", "").get("", (0.0, 0.0))
    check = histogram_sums(f"http://{pair.d['metrics']}/metrics", "kvd_pull_phase_seconds", "phase").get("verify", (0.0, 0.0))
    transfer = histogram_sums(f"http://{pair.d['metrics']}/metrics", "kvd_pull_phase_seconds", "phase").get("transfer", (0.0, 0.0))
    return digest[0] + check[0], transfer[0]


def bench_verify(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    nbytes, layers = args.transfer_mib << 20, args.verify_layers
    out: dict[str, Any] = {}
    say(f"verify: one request of {args.transfer_mib} MiB in 1 MiB units, {layers} layers, with --verify off, sampled and full; "
        f"{args.repeat} tries each, alternating")
    for path in ("tcp", "samehost"):
        with contextlib.ExitStack() as stack:
            pairs = {}
            for mode in MODES:  # all launched before any is prepared: they boot in parallel
                pairs[mode] = pair = BenchPair(path, ("--verify", mode))
                stack.callback(pair.close)
            for mode, pair in pairs.items():
                pair.prepare(f"verify-{path}-{mode}", 1 << 20, nbytes, layers, random.Random(0))
            before = _verify_seconds(pairs["sampled"])
            tries: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
            read_pass = hash_pass = float("inf")
            for _ in range(args.repeat):
                for mode, pair in pairs.items():
                    tries[mode].append(pair.one_try())
                passes = _pass_seconds_per_gb(nbytes, 1)
                read_pass, hash_pass = min(read_pass, passes[0]), min(hash_pass, passes[1])
            after = _verify_seconds(pairs["sampled"])
        gbps = {m: max(g for g, _ in tries[m]) for m in MODES}
        cpu = {m: statistics.median(c for _, c in tries[m]) for m in MODES}
        out[f"verify_sampled_cost_{path}"] = (after[0] - before[0]) / (after[1] - before[1])
        out[f"verify_sampled_vs_off_{path}"] = gbps["sampled"] / gbps["off"]
        out[f"verify_full_cpu_vs_off_{path}"] = cpu["full"] / cpu["off"]
        out[f"verify_full_floor_{path}"] = (cpu["off"] + 2 * read_pass) / cpu["off"]
        out[f"verify_full_hash_floor_{path}"] = (cpu["off"] + 2 * hash_pass) / cpu["off"]
        for mode in MODES:
            out[f"verify_{path}_{mode}_gbps"] = gbps[mode]
            out[f"verify_{path}_{mode}_cpu_s_per_gb"] = cpu[mode]
        say(f"  {path:<9} {'mode':<8} {'GB/s':>6} {'CPU s/GB':>9}")
        for mode in MODES:
            say(f"  {'':<9} {mode:<8} {gbps[mode]:6.2f} {cpu[mode]:9.3f}")
        say(f"    sampled adds {out[f'verify_sampled_cost_{path}']:.1%} to each request's transfer time (owner's digest + reader's check); "
            f"throughput sampled / off {out[f'verify_sampled_vs_off_{path}']:.2f}")
        say(f"    full costs {out[f'verify_full_cpu_vs_off_{path}']:.2f}x the CPU per GB of off; reading every byte once on each side "
            f"({read_pass:.3f} s/GB a pass) would cost {out[f'verify_full_floor_{path}']:.2f}x, hashing it once with numpy's dot "
            f"({hash_pass:.3f} s/GB) {out[f'verify_full_hash_floor_{path}']:.2f}x")
    return out
