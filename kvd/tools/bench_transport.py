"""The transport section of ``kvd bench``: real daemons moving one request of
scattered blocks at several unit sizes, over TCP and the same-host path,
against a plain socket (1..k connections, k kvd's stripes), the best memcpy,
the kernel's own pace for the same pieces, NIXL and Mooncake where installed;
and a small request's latency against its floor and the sidecar's process
chain alone."""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec
from kvd.daemon.config import DaemonConfig
from kvd.tools.bench_memcpy import BestMemcpy
from kvd.tools.bench_pair import BenchPair, p50, p99
from kvd.tools.bench_scatter import ScatteredSocket
from kvd.tools.bench_skeleton import SkeletonPull
from kvd.tools.bench_socket import best_socket, socket_round_trip

UNIT_SIZES = {"16k": 16 << 10, "64k": 64 << 10, "1m": 1 << 20}
# kvd TCP's 16 KiB / 1 MiB against the kernel's own for the same pieces is
# judged as the median of this many paired tries (kvd's two unit sizes and the
# kernel's two, one after the other): the ratio of four speeds, each swinging
# by 2x here within minutes, taken from four different tries' bests said more
# of the machine than of kvd.
PAIRED_TRIES = 5


Try = Callable[[], tuple[float, float]]  # one timed try: GB/s, CPU seconds per GB


def _interleaved(pairs: dict[str, BenchPair], baseline: Try, tries: int,
                 floors: dict[str, Any] | None = None) -> tuple[list[tuple[float, float]], dict[str, list[tuple[float, float]]], dict[str, list[float]]]:
    """``tries`` rounds of one baseline try, then one try at each unit size
    (``pairs``, prepared), and one of each of ``floors`` (GB/s), each side's
    tries in order: this machine's speed swings by 2x within minutes, and a
    slow spell must fall on both sides of every ratio, not on one."""
    base: list[tuple[float, float]] = []
    kvd: dict[str, list[tuple[float, float]]] = {label: [] for label in pairs}
    paces: dict[str, list[float]] = {label: [] for label in floors or {}}
    for _ in range(tries):
        base.append(baseline())
        for label, pair in pairs.items():
            kvd[label].append(pair.one_try())
        for label, floor in (floors or {}).items():
            paces[label].append(floor.one_try())
    return base, kvd, paces


@dataclass
class _NixlTry:
    """One unit size of a ``NixlPair``, tried in turn with kvd's."""

    pair: Any
    unit: int

    def one_try(self) -> float:
        return float(self.pair.one_try(self.unit))


def _socket_try(nbytes: int, connections: int, used: dict[str, Any]) -> Try:
    """One try of the best plain socket over 1..``connections`` connections
    (as many as kvd stripes a read over); ``used`` keeps how many the best
    try of the round took."""

    def one() -> tuple[float, float]:
        cpu: dict[str, float] = {}
        gbps, k = best_socket(nbytes, 1, connections, cpu)
        if gbps > used.get("best_gbps", 0.0):
            used["best_gbps"], used["connections"] = gbps, k
        return gbps, cpu["s_per_gb"]

    return one


def _memcpy_try(memcpy: BestMemcpy, used: dict[str, Any]) -> Try:
    """One try of the best memcpy over 1..cores threads; ``used`` keeps the
    thread count of the round's best."""

    def one() -> tuple[float, float]:
        gbps = memcpy.src.numel() / memcpy.best_seconds() / 1e9
        if gbps > used.get("best_gbps", 0.0):
            used["best_gbps"], used["threads"] = gbps, memcpy.threads
        return gbps, 0.0

    return one


def _small_request(pair: BenchPair, requests: int, say: Callable[[str], None]) -> dict[str, Any]:
    """A small request's latency, pull to the engine's finished set, and its
    floor: what the same request costs with nothing around it, one gRPC
    round trip to the daemon on the worker socket (the pull call and the
    finished-set push are one each way) and one plain socket round trip
    carrying the request's bytes. Beside them, the same request through
    kvd's process chain with no kvd logic (``bench_skeleton``): what the
    shape itself costs. All four are measured in four parts that alternate."""
    spec = KVCacheSpec(16, 8, 128, "bfloat16", NAMED_LAYOUTS["NHD"], 64)
    layers = 4
    pair.register(spec, layers)
    small_bytes = 16 * spec.bytes_per_block_per_layer * layers
    lat: list[float] = []
    rpc: list[float] = []
    sock: list[float] = []
    skel: list[float] = []
    before = pair.timings()
    skeleton = SkeletonPull(spec.bytes_per_block_per_layer, 16 * layers)
    try:
        for part in range(4):
            count = max(1, requests // 4)
            lat += [pair.transfer(f"small-{part}-{i}", list(range(1, 17)), list(range(17, 33)), 256) for i in range(count)]
            for _ in range(count):
                t0 = time.perf_counter()
                pair.d_client.get_finished()
                rpc.append(time.perf_counter() - t0)
            sock += socket_round_trip(small_bytes, count)
            skel += [skeleton.one() for _ in range(count)]
    finally:
        skeleton.close()
    after = pair.timings()
    # Where the time goes: D's pull phases and P serving its read, mean ms a request.
    phases = {k: (after[k][0] - before.get(k, (0.0, 0.0))[0]) / (after[k][1] - before.get(k, (0.0, 0.0))[1]) * 1e3
              for k in after if after[k][1] > before.get(k, (0.0, 0.0))[1]}
    out: dict[str, Any] = {"small_request_phases_ms": phases, "small_request_p50_ms": p50(lat) * 1e3, "small_request_p99_ms": p99(lat) * 1e3,
           "grpc_round_trip_ms": p50(rpc) * 1e3, "socket_round_trip_ms": p50(sock) * 1e3,
           "skeleton_p50_ms": p50(skel) * 1e3, "skeleton_p99_ms": p99(skel) * 1e3}
    out["small_request_floor_ms"] = out["grpc_round_trip_ms"] + out["socket_round_trip_ms"]
    say(f"  {f'small request (16 blocks, {small_bytes / (1 << 20):.0f} MiB) p50/p99':<34} {out['small_request_p50_ms']:6.2f} / {out['small_request_p99_ms']:.2f} ms")
    say(f"  {'  floor: gRPC + socket round trips':<34} {out['small_request_floor_ms']:6.2f} ms "
        f"({out['grpc_round_trip_ms']:.2f} + {out['socket_round_trip_ms']:.2f}; p50s)")
    say(f"  {'  its process chain alone p50/p99':<34} {out['skeleton_p50_ms']:6.2f} / {out['skeleton_p99_ms']:.2f} ms")
    d_part = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "serve")
    say(f"  {'  where it goes (mean ms)':<34} D: {d_part}; P serves its read in {phases.get('serve', 0.0):.2f}")
    return out


def bench_transport(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    nbytes = args.transfer_mib << 20
    layers = 4
    rng = random.Random(0)
    out: dict[str, Any] = {}
    say(f"transport: one request of {args.transfer_mib} MiB, scattered block ids, {layers} layers; best of {args.repeat} tries "
        f"({max(args.repeat, PAIRED_TRIES)} over TCP), which alternate with the baseline's")
    from kvd.tools.bench_peers import NixlPair, nixl_installed

    nixl = nixl_installed()
    modes = ("tcp", "samehost", "nixl") if nixl else ("tcp", "samehost")
    for mode in modes:
        units = {"1m": UNIT_SIZES["1m"], "16k": UNIT_SIZES["16k"]} if mode == "samehost" else UNIT_SIZES
        with contextlib.ExitStack() as stack:
            # A pair of daemons per unit size, all up at once, so their tries can alternate
            # (all launched before any is prepared: they boot in parallel).
            pairs = {}
            for label in units:
                pairs[label] = pair = BenchPair(mode)
                stack.callback(pair.close)
            for label, unit in units.items():
                pairs[label].prepare(f"{mode}-{label}", unit, nbytes, layers, rng)
            stripes = DaemonConfig("bench").stripes_per_read
            used: dict[str, Any] = {}
            if mode == "samehost":
                memcpy = BestMemcpy(nbytes)
                stack.callback(memcpy.close)
                base_name, base_key, baseline = "memcpy, best of 1..cores threads", "memcpy_gbps", _memcpy_try(memcpy, used)
            else:
                base_name, base_key = f"plain socket, 1 MiB sendall, best of 1..{stripes} conns", "socket_gbps" if mode == "tcp" else f"{mode}_socket_gbps"
                baseline = _socket_try(nbytes, stripes, used)
            # Other paces tried in turn with kvd's, by the key they are reported under:
            floors: dict[str, Any] = {}
            if mode == "tcp":
                # the kernel's own for the pieces of 16 KiB and 1 MiB units (half a unit: K or V),
                # over as many connections as kvd stripes these reads across;
                for label in ("16k", "1m"):
                    floors[f"socket_scattered_{label}_gbps"] = floor = ScatteredSocket(nbytes, UNIT_SIZES[label] // 2, stripes)
                    stack.callback(floor.close)
            if nixl and mode in ("tcp", "samehost"):
                # and NIXL's: like with like, UCX over TCP against kvd's TCP, UCX's own pick (shm, CMA) against same-host.
                peer = NixlPair(nbytes, "tcp" if mode == "tcp" else "", stripes)
                stack.callback(peer.close)
                name = "tcp" if mode == "tcp" else "default"
                for label in units:
                    floors[f"nixl_{name}_{label}_gbps"] = _NixlTry(peer, UNIT_SIZES[label])
            tries = max(args.repeat, PAIRED_TRIES) if mode == "tcp" else args.repeat
            base, kvd, paces = _interleaved(pairs, baseline, tries, floors)
            floor_gbps = {key: max(each) for key, each in paces.items()}
            if mode == "tcp":
                # Each try's four speeds (kvd 16 KiB, 1 MiB; the kernel's 16 KiB, 1 MiB), and the median of their ratio.
                paired = [[k16[0], k1m[0], s16, s1m] for k16, k1m, s16, s1m in
                          zip(kvd["16k"], kvd["1m"], paces["socket_scattered_16k_gbps"], paces["socket_scattered_1m_gbps"], strict=True)]
                out["tcp_16k_vs_kernel_tries"] = paired
                out["tcp_16k_vs_kernel"] = statistics.median((a / b) / (c / d) for a, b, c, d in paired)
            nixl_pairs = {id(f.pair): f for f in floors.values() if isinstance(f, _NixlTry)}
            for f in nixl_pairs.values():  # every unit size reads the whole buffer: one check a pair
                f.pair.check(f.unit)
            del baseline  # memcpy's buffers: 2x the request
            out[base_key] = max(g for g, _ in base)
            if "connections" in used:
                out[base_key.replace("_gbps", "_connections")] = used["connections"]
            if "threads" in used:
                out["memcpy_threads"] = used["threads"]
            on = f"  (best on {used['connections']} connections)" if "connections" in used else ""
            on += f"  (best on {used['threads']} threads)" if "threads" in used else ""
            say(f"  {base_name:<34} {out[base_key]:6.2f} GB/s{on}")
            for key, gbps in floor_gbps.items():
                out[key] = gbps
                label = key.rsplit("_", 2)[1]
                if key.startswith("socket_scattered"):
                    say(f"  {f'plain sendmsg, {label} units scattered':<34} {gbps:6.2f} GB/s  (kvd TCP's pieces and connections, nothing else)")
                else:
                    ucx = "UCX_TLS=tcp" if "_tcp_" in key else "UCX default"
                    say(f"  {f'NIXL ({ucx}), {label} units':<34} {gbps:6.2f} GB/s  (descriptor lists prepared once, {stripes} UCX threads)")
            if mode == "tcp":
                # The median of the round's tries (at least 3), each side's CPU in nanoseconds.
                out["socket_cpu_s_per_gb"] = statistics.median(c for _, c in base)
                out["tcp_cpu_s_per_gb"] = statistics.median(c for _, c in kvd["1m"])
            for label in units:
                best = out[f"{mode}_{label}_gbps"] = max(g for g, _ in kvd[label])
                say(f"  {f'kvd {mode}, {label} units':<34} {best:6.2f} GB/s{'  (kvd over NIXL/UCX, default transports)' if mode == 'nixl' else ''}")
            if mode == "tcp":
                out.update(_small_request(pairs["1m"], args.latency_requests, say))
    # Each ratio's two sides come from tries that alternated.
    out["tcp_vs_socket_1m"] = out["tcp_1m_gbps"] / out["socket_gbps"]
    out["tcp_cpu_vs_socket"] = out["tcp_cpu_s_per_gb"] / out["socket_cpu_s_per_gb"]
    out["tcp_16k_vs_1m"] = out["tcp_16k_gbps"] / out["tcp_1m_gbps"]
    out["socket_scattered_16k_vs_1m"] = out["socket_scattered_16k_gbps"] / out["socket_scattered_1m_gbps"]
    out["samehost_vs_memcpy"] = out["samehost_1m_gbps"] / out["memcpy_gbps"]
    out["vs_nixl"] = None
    out["nixl_prepped"] = NixlPair.prepped if nixl else None
    if nixl:
        # Like with like, each pair of figures from tries that alternated.
        ratios = [out[f"tcp_{label}_gbps"] / out[f"nixl_tcp_{label}_gbps"] for label in UNIT_SIZES]
        ratios += [out[f"samehost_{label}_gbps"] / out[f"nixl_default_{label}_gbps"] for label in ("1m", "16k")]
        out["vs_nixl"] = min(ratios)
    from kvd.tools.bench_peers import mooncake_installed, mooncake_read_gbps

    out["vs_mooncake"] = None
    out["mooncake_missing"] = mooncake_installed()
    if not out["mooncake_missing"]:
        # Like with like: Mooncake's tcp protocol against kvd's TCP path.
        ratios = []
        for label, unit in UNIT_SIZES.items():
            out[f"mooncake_tcp_{label}_gbps"] = mooncake_read_gbps(nbytes, unit, args.repeat)
            say(f"  {f'Mooncake TE (tcp), {label} units':<34} {out[f'mooncake_tcp_{label}_gbps']:6.2f} GB/s")
            ratios.append(out[f"tcp_{label}_gbps"] / out[f"mooncake_tcp_{label}_gbps"])
        out["vs_mooncake"] = min(ratios)
    return out
