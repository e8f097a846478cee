"""``kvd bench``: speed, as ratios to baselines measured in the same run.

Sections:

* ``relayout``: landing received bytes into a different layout, block size
  or head slice (what D does after every receive), against a plain memcpy of
  the same number of bytes.
* ``transport``: real daemons moving one request of scattered blocks at
  several unit sizes (bytes of one block of one layer), over TCP and over the
  same-host path, against a plain two-process socket and a memcpy (and the
  kernel's own pace for the same scattered pieces: ``bench_scatter``); plus the
  latency of a small request from pull to the engine's finished set, against
  its floor on this machine (a gRPC round trip plus a plain socket round trip
  of the same bytes).
* ``control``: kvd's control plane per request from 1k to 100k blocks
  (publish, pull, plan, READ messages, authorisation), and a 128k-token
  request's against its transfer time.
* ``stream``: what the transfer adds to TTFT, from 256 to 32k tokens,
  pulled after prefill against streamed layer by layer while prefill
  computes (``bench_stream``).
* ``load`` (once a run, after the rounds): the daemons' own memory over
  ``--load-seconds`` of requests of mixed sizes (``bench_load``).
* ``gpu`` (where CUDA is available): GPU caches on both sides, over TCP
  against a plain socket and the pinned PCIe copies, and same-host (CUDA IPC)
  against a device memcpy.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvd.core.pieces import serve_segment
from kvd.core.reads import Offer
from kvd.core.sinks import SegmentSink
from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
from kvd.core.topology import heads_of_rank
from kvd.core.transfer import plan_pull
from kvd.daemon.config import DaemonConfig
from kvd.testing import pattern
from kvd.testing.sim import make_engine
from kvd.tools.bench_control import bench_control
from kvd.tools.bench_gpu import bench_gpu
from kvd.tools.bench_load import bench_load
from kvd.tools.bench_memcpy import BestMemcpy
from kvd.tools.bench_pair import BenchPair
from kvd.tools.bench_pair import best_seconds as _best
from kvd.tools.bench_peers import best_socket, socket_round_trip
from kvd.tools.bench_report import add_derived, print_verdict, verdict, worst_of
from kvd.tools.bench_scatter import ScatteredSocket
from kvd.tools.bench_skeleton import SkeletonPull
from kvd.tools.bench_state import state_work
from kvd.tools.bench_stream import TOKENS, bench_stream
from kvd.transport.base import Staging
from kvd.transport.copy_threads import Batch, CopyThreads


@dataclass(frozen=True)
class Pairing:
    name: str
    p_tp: int
    d_tp: int
    p_bs: int
    d_bs: int
    p_layout: str
    d_layout: str


RELAYOUT_PAIRINGS = [
    Pairing("same layout (NHD -> NHD)", 1, 1, 16, 16, "NHD", "NHD"),
    Pairing("HND -> NHD", 1, 1, 16, 16, "HND", "NHD"),
    Pairing("NHD -> K/V split HND", 1, 1, 16, 16, "NHD", "HND_SPLIT"),
    Pairing("FlashInfer HND -> NHD", 1, 1, 16, 16, "HND_BLOCKS_FIRST", "NHD"),
    Pairing("block 16 -> 64 (merge), HND -> NHD", 1, 1, 16, 64, "HND", "NHD"),
    Pairing("block 128 -> 32 (split)", 1, 1, 128, 32, "NHD", "NHD"),
    Pairing("TP2 -> TP1 head gather, HND -> NHD", 2, 1, 16, 16, "HND", "NHD"),
]


def bench_relayout(pairing: Pairing, *, layers: int, heads: int, head_size: int, tokens: int, repeat: int) -> dict[str, Any]:
    """Time D landing every segment of one request, vs memcpy of the same bytes."""
    rng = random.Random(0)
    model = ModelInfo(layers, heads)

    def spec_of(tp: int, bs: int, layout: str, nb: int) -> Callable[[int], KVCacheSpec]:
        return lambda r: KVCacheSpec(bs, heads_of_rank(r, tp, heads, False).count, head_size, "bfloat16", NAMED_LAYOUTS[layout], nb)

    n_p, n_d = -(-tokens // pairing.p_bs), -(-tokens // pairing.d_bs)
    p = make_engine("P", pairing.p_tp, 1, model, spec_of(pairing.p_tp, pairing.p_bs, pairing.p_layout, n_p + 1), rng)
    d = make_engine("D", pairing.d_tp, 1, model, spec_of(pairing.d_tp, pairing.d_bs, pairing.d_layout, n_d + 1), rng)
    p_ids, d_ids = list(range(1, n_p + 1)), list(range(1, n_d + 1))
    for r in p.ranks.values():
        pattern.fill(r.tensors, 1, p_ids, r.coords)
    params = Offer(request_id="r", generation=1, capability=b"", block_ids=(tuple(p_ids),), num_tokens=tokens)
    rank = d.ranks[(0, 0)]
    reads = plan_pull(local_meta=d.meta, local_tp_rank=0, local_pp_rank=0, local_groups=[rank.tensors], local_group_specs=[rank.group],
                      remote=p.meta, params=params, local_block_ids=[d_ids])
    staging = Staging()
    per_rank = []
    for rr in reads:
        owner = p.ranks[(rr.read.tp_rank, rr.read.pp_rank)]
        per_rank.append([(sink, serve_segment(owner.tensors, seg, *rr.read.heads_of(seg), staging).clone())
                         for seg, sink in zip(rr.read.segments, rr.sinks, strict=True)])
    # A daemon reads every remote rank at once, each on its own connection,
    # so their segments land side by side: the k-th of each rank, then the next.
    work = [w for ws in itertools.zip_longest(*per_rank) for w in ws if w is not None]
    return relayout_row(pairing.name, work, lambda: pattern.mismatch(rank.tensors, 1, d_ids, rank.coords, tokens), repeat, len(per_rank))


Work = list[tuple[SegmentSink, torch.Tensor]]  # each received segment's sink and payload


def relayout_row(name: str, work: Work, check: Callable[[], str | None], repeat: int, connections: int = 1) -> dict[str, Any]:
    """Time landing every received segment against memcpy of the same
    bytes, then ``check`` the landed bytes (a mismatch stops the bench)."""
    nbytes = sum(s.nbytes for s, _ in work)

    threads = CopyThreads(DaemonConfig("bench").copy_threads)  # as a daemon lands them
    # A daemon's reader hands each received segment to the copy threads and
    # receives the next; it waits only for the landing of the staging buffer
    # it fills next (two buffers a connection).
    depth = 2 * connections

    def land() -> None:
        pending: collections.deque[Batch] = collections.deque()
        for sink, payload in work:
            if len(pending) == depth:
                pending.popleft().wait(help=False)
            pending.append(threads.submit_copies(sink.put_copies(payload)))
        for batch in pending:
            batch.wait(help=False)

    memcpy = BestMemcpy(nbytes)  # the best of 1..cores threads, on the same bytes
    # Tries alternate, so a slow spell of this shared machine falls on both
    # sides of the ratio rather than on one.
    t_relayout = t_memcpy = float("inf")
    used = 1
    try:
        for _ in range(repeat):
            t_relayout = min(t_relayout, _best(land, 1))
            t = memcpy.best_seconds()
            if t < t_memcpy:
                t_memcpy, used = t, memcpy.threads
    finally:
        threads.close()
        memcpy.close()
    bad = check()
    if bad:
        raise SystemExit(f"relayout bench produced wrong bytes for {name}: {bad}")
    return {
        "pairing": name,
        "bytes": nbytes,
        "relayout_gbps": nbytes / t_relayout / 1e9,
        "memcpy_gbps": nbytes / t_memcpy / 1e9,
        "memcpy_threads": used,
        "ratio": t_memcpy / t_relayout,
    }


# ---------------------------------------------------------------- transport

UNIT_SIZES = {"16k": 16 << 10, "64k": 64 << 10, "1m": 1 << 20}


def _p50(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def _p99(samples: list[float]) -> float:
    return sorted(samples)[min(len(samples) - 1, int(len(samples) * 0.99))]


Try = Callable[[], tuple[float, float]]  # one timed try: GB/s, CPU seconds per GB


def _interleaved(pairs: dict[str, BenchPair], baseline: Try, tries: int,
                 floors: dict[str, Any] | None = None) -> tuple[list[tuple[float, float]], dict[str, list[tuple[float, float]]], dict[str, float]]:
    """``tries`` rounds of one baseline try, then one try at each unit size
    (``pairs``, prepared), and one of each of ``floors`` (best GB/s each):
    this machine's speed swings by 2x within minutes, and a slow spell must
    fall on both sides of every ratio, not on one."""
    base: list[tuple[float, float]] = []
    kvd: dict[str, list[tuple[float, float]]] = {label: [] for label in pairs}
    best = dict.fromkeys(floors or {}, 0.0)
    for _ in range(tries):
        base.append(baseline())
        for label, pair in pairs.items():
            kvd[label].append(pair.one_try())
        for label, floor in (floors or {}).items():
            best[label] = max(best[label], floor.one_try())
    return base, kvd, best


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
    out: dict[str, Any] = {"small_request_phases_ms": phases, "small_request_p50_ms": _p50(lat) * 1e3, "small_request_p99_ms": _p99(lat) * 1e3,
           "grpc_round_trip_ms": _p50(rpc) * 1e3, "socket_round_trip_ms": _p50(sock) * 1e3,
           "skeleton_p50_ms": _p50(skel) * 1e3, "skeleton_p99_ms": _p99(skel) * 1e3}
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
    say(f"transport: one request of {args.transfer_mib} MiB, scattered block ids, {layers} layers; best of {args.repeat} tries, "
        "which alternate with the baseline's")
    from kvd.tools.bench_peers import NixlPair, nixl_installed

    nixl = nixl_installed()
    modes = ("tcp", "samehost", "nixl") if nixl else ("tcp", "samehost")
    for mode in modes:
        units = {"1m": UNIT_SIZES["1m"], "16k": UNIT_SIZES["16k"]} if mode == "samehost" else UNIT_SIZES
        with contextlib.ExitStack() as stack:
            # A pair of daemons per unit size, all up at once, so their tries can alternate.
            pairs = {}
            for label, unit in units.items():
                pairs[label] = pair = BenchPair(mode)
                stack.callback(pair.close)
                pair.prepare(f"{mode}-{label}", unit, nbytes, layers, rng)
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
            base, kvd, floor_gbps = _interleaved(pairs, baseline, args.repeat, floors)
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


TRIES_PER_ROUND = 3  # the CPU per GB is the median of a round's tries: at least 3


def run_bench(args: argparse.Namespace) -> int:
    """``--repeat`` rounds, each measuring every figure beside its baseline;
    the verdict is each figure's worst round."""
    torch.set_num_threads(1)
    if args.repeat < 1:
        raise SystemExit(f"kvd bench: --repeat={args.repeat} must be at least 1 (rounds)")
    if "load" in args.sections and not args.load_seconds > 0:
        raise SystemExit(f"kvd bench: --load-seconds={args.load_seconds:g} must be positive")

    def say(line: str) -> None:
        # With --json the figures are stdout's; the progress of a 20-minute run goes to stderr.
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    rounds = []
    for k in range(args.repeat):
        if args.repeat > 1:
            say(f"{chr(10) if k else ''}== round {k + 1} of {args.repeat}")
        rounds.append(_one_round(argparse.Namespace(**{**vars(args), "repeat": TRIES_PER_ROUND}), say))
    if "load" in args.sections:  # once a run: it is long, and memory growth is not noise
        say("")
        rounds[-1].update(bench_load(args.load_seconds, say))
    rows = verdict(rounds)
    print_verdict(rows, len(rounds), say)
    if args.json:
        print(json.dumps({**worst_of(rounds), "rounds": rounds, "verdict": rows}, indent=2))
    return 0


def _one_round(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if "relayout" in args.sections:
        rows = []
        say(f"relayout: one request of {args.tokens} tokens, {args.layers} layers, {args.kv_heads} KV heads x {args.head_size} bf16, vs memcpy of the same bytes")
        say(f"  {'pairing':<40} {'MB':>8} {'relayout GB/s':>14} {'memcpy GB/s':>12} {'ratio':>6}")
        for pairing in RELAYOUT_PAIRINGS:
            row = bench_relayout(pairing, layers=args.layers, heads=args.kv_heads, head_size=args.head_size, tokens=args.tokens, repeat=args.repeat)
            rows.append(row)
            say(f"  {row['pairing']:<40} {row['bytes'] / 1e6:8.1f} {row['relayout_gbps']:14.2f} {row['memcpy_gbps']:12.2f} {row['ratio']:6.2f}")
        # A hybrid model's state: small per request, and part of the worst pairing like any other.
        row = relayout_row(*state_work(layers=args.layers, heads=args.kv_heads, head_size=args.head_size, requests=64), args.repeat)
        say(f"  {row['pairing']:<40} {row['bytes'] / 1e6:8.1f} {row['relayout_gbps']:14.2f} {row['memcpy_gbps']:12.2f} {row['ratio']:6.2f}")
        results["state_relayout"] = row
        rows.append(row)
        results["relayout"] = rows
        results["relayout_vs_memcpy_min"] = min(float(r["ratio"]) for r in rows)
        results["memcpy_threads"] = max(int(r["memcpy_threads"]) for r in rows)
    if "transport" in args.sections:
        t = bench_transport(args, say)
        add_derived(t)
        results.update(t)
        say("  ratios (this round):")
        say(f"    tcp_vs_socket_1m    {t['tcp_vs_socket_1m']:.2f}")
        say(f"    tcp_16k_vs_1m       {t['tcp_16k_vs_1m']:.2f}  (plain sendmsg of the same pieces: {t['socket_scattered_16k_vs_1m']:.2f})")
        say(f"    tcp_cpu_vs_socket   {t['tcp_cpu_vs_socket']:.2f}  (CPU s per GB: {t['tcp_cpu_s_per_gb']:.2f} both daemons and the workers, "
            f"{t['socket_cpu_s_per_gb']:.2f} both socket ends)")
        say(f"    samehost_vs_memcpy  {t['samehost_vs_memcpy']:.2f}")
        say(f"    small_request       p50 {t['small_request_p50_vs_floor']:.2f} x its floor, p99 {t['small_request_p99_vs_floor']:.2f} x  "
            f"(its process chain alone: {t['skeleton_p50_vs_floor']:.2f} x, {t['skeleton_p99_vs_floor']:.2f} x)")
        if t["vs_nixl"] is None:
            say("    vs_nixl             not measured: NIXL is not installed (pip install 'kvd[nixl]')")
        else:
            say(f"    vs_nixl             {t['vs_nixl']:.2f}  (kvd / NIXL, worst unit size, TCP vs UCX tcp and same-host vs UCX default)")
        if t["vs_mooncake"] is None:
            say(f"    vs_mooncake         not measured: {t['mooncake_missing']}")
        else:
            say(f"    vs_mooncake         {t['vs_mooncake']:.2f}  (kvd TCP / Mooncake TE tcp, worst unit size)")
    if "control" in args.sections:
        results.update(bench_control(layers=args.layers, heads=args.kv_heads, head_size=args.head_size, repeat=args.repeat,
                                     wire_gbps=results.get("socket_gbps"), say=say))
    if "stream" in args.sections:
        results.update(bench_stream(layers=args.stream_layers, heads=args.stream_kv_heads, head_size=args.head_size,
                                    us_per_token=args.stream_us_per_token, repeat=args.repeat, tokens=tuple(args.stream_tokens), say=say))
    if "gpu" in args.sections:
        results.update(bench_gpu(args, say))
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--sections", nargs="+", default=["relayout", "transport", "control", "stream", "load", "gpu"],
                   choices=["relayout", "transport", "control", "stream", "load", "gpu"],
                   help="gpu is measured only where CUDA is available; load runs once, after the rounds")
    p.add_argument("--transfer-mib", type=int, default=256, help="bytes of one transport request")
    p.add_argument("--latency-requests", type=int, default=200)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--stream-layers", type=int, default=32, help="stream section: model layers (a real model's count: streaming's gain is per layer)")
    p.add_argument("--stream-kv-heads", type=int, default=2)
    p.add_argument("--stream-us-per-token", type=float, default=3.0,
                   help="stream section: prefill compute per token per layer (3: an 8B model on one H100)")
    p.add_argument("--stream-tokens", type=int, nargs="+", default=list(TOKENS), help="stream section: prompt lengths")
    p.add_argument("--load-seconds", type=float, default=300.0, help="load section: how long the daemons move requests")
    p.add_argument("--repeat", type=int, default=3, help="rounds; each figure is reported as its worst round")
