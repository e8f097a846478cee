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
* ``verify``: what end-to-end verification costs, sampled and full, over
  TCP and same-host, against the same pairs with it off (``bench_verify``).
* ``qos``: the wire's order under load: small pulls' p99 beside bulk ones,
  tenants' shares, a best-effort tenant (``bench_qos``).
* ``load`` (once a run, after the rounds): the daemons' own memory over
  ``--load-seconds`` of requests of mixed sizes (``bench_load``).
* ``gpu`` (where CUDA is available): GPU caches on both sides, over TCP
  against a plain socket and the pinned PCIe copies, and same-host (CUDA IPC)
  against a device memcpy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from kvd.tools.arguments import POSITIVE, seconds
from kvd.tools.bench_control import bench_control
from kvd.tools.bench_gpu import bench_gpu
from kvd.tools.bench_load import bench_load
from kvd.tools.bench_qos import bench_qos
from kvd.tools.bench_relayout import RELAYOUT_PAIRINGS, bench_relayout, relayout_row
from kvd.tools.bench_report import add_derived, print_verdict, verdict, worst_of
from kvd.tools.bench_state import state_work
from kvd.tools.bench_stream import TOKENS, bench_stream
from kvd.tools.bench_transport import bench_transport
from kvd.tools.bench_verify import bench_verify

TRIES_PER_ROUND = 3  # the CPU per GB is the median of a round's tries: at least 3


def run_bench(args: argparse.Namespace) -> int:
    """``--repeat`` rounds, each measuring every figure beside its baseline;
    the verdict is each figure's worst round."""
    torch.set_num_threads(1)  # every option was checked as it was parsed (kvd/tools/arguments.py)

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
        say(f"    tcp_16k_vs_1m       {t['tcp_16k_vs_1m']:.2f}  (plain sendmsg of the same pieces: {t['socket_scattered_16k_vs_1m']:.2f}; "
            f"over it, the median of {len(t['tcp_16k_vs_kernel_tries'])} paired tries: {t['tcp_16k_vs_kernel']:.2f})")
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
    if "verify" in args.sections:
        results.update(bench_verify(args, say))
    if "qos" in args.sections:
        results.update(bench_qos(args, say))
    if "gpu" in args.sections:
        results.update(bench_gpu(args, say))
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--sections", nargs="+", default=["relayout", "transport", "control", "stream", "verify", "qos", "load", "gpu"],
                   choices=["relayout", "transport", "control", "stream", "verify", "qos", "load", "gpu"],
                   help="gpu is measured only where CUDA is available; load runs once, after the rounds")
    p.add_argument("--transfer-mib", type=POSITIVE, default=256, help="bytes of one transport request")
    p.add_argument("--latency-requests", type=POSITIVE, default=200, help="transport section: small requests timed for p50 and p99")
    p.add_argument("--layers", type=POSITIVE, default=8, help="relayout and control sections (and the state row): model layers")
    p.add_argument("--kv-heads", type=POSITIVE, default=8, help="relayout and control sections (and the state row): KV heads")
    p.add_argument("--head-size", type=POSITIVE, default=128, help="relayout, control and stream sections: head size")
    p.add_argument("--tokens", type=POSITIVE, default=4096, help="relayout section: tokens of one request")
    p.add_argument("--stream-layers", type=POSITIVE, default=32, help="stream section: model layers (a real model's count: streaming's gain is per layer)")
    p.add_argument("--stream-kv-heads", type=POSITIVE, default=2, help="stream section: KV heads")
    p.add_argument("--stream-us-per-token", type=seconds(positive=False), default=3.0,
                   help="stream section: prefill compute per token per layer (3: an 8B model on one H100)")
    p.add_argument("--stream-tokens", type=POSITIVE, nargs="+", default=list(TOKENS), help="stream section: prompt lengths")
    p.add_argument("--load-seconds", type=seconds(positive=True), default=300.0, help="load section: how long the daemons move requests")
    p.add_argument("--verify-layers", type=POSITIVE, default=32,
                   help="verify section: model layers (a real model's count: a sample's cost is per token, and a 4-layer model has 8x fewer bytes a token)")
    p.add_argument("--qos-bulk-mib", type=POSITIVE, default=1024, help="qos section: bytes of one bulk pull")
    p.add_argument("--qos-small-mib", type=POSITIVE, default=4, help="qos section: bytes of one small pull")
    p.add_argument("--qos-small-pulls", type=POSITIVE, default=40, help="qos section: small pulls timed idle, and twice as many under bulk")
    p.add_argument("--qos-share-seconds", type=seconds(positive=True), default=3.0, help="qos section: the window tenants' bytes are counted over")
    p.add_argument("--repeat", type=POSITIVE, default=3, help="rounds; each figure is reported as its worst round")
