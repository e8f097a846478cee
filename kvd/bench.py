"""``kvd bench``: speed, as ratios to baselines measured in the same run.

Sections:

* ``relayout``: landing received bytes into a different layout, block size
  or head slice (what D does after every receive), against a plain memcpy of
  the same number of bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvd import pattern
from kvd.proto import kvd_pb2 as pb
from kvd.sim import make_engine
from kvd.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
from kvd.topology import heads_of_rank
from kvd.transfer import plan_pull, serve_segment
from kvd.transport.base import Staging


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


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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
    params = pb.TransferParams(remote_engine_id="P", request_id="r", generation=1, num_tokens=tokens, block_ids=[pb.BlockIds(ids=p_ids)])
    rank = d.ranks[(0, 0)]
    reads = plan_pull(local_meta=d.meta, local_tp_rank=0, local_pp_rank=0, local_groups=[rank.tensors], local_group_specs=[rank.group],
                      remote=p.meta, params=params, local_block_ids=[d_ids])
    staging = Staging()
    work = []
    for rr in reads:
        owner = p.ranks[(rr.read.tp_rank, rr.read.pp_rank)]
        for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
            work.append((sink, serve_segment(owner.tensors, seg, rr.read.head_start, rr.read.head_count, staging).clone()))
    nbytes = sum(s.nbytes for s, _ in work)

    def land() -> None:
        for sink, payload in work:
            direct = sink.direct()
            if direct is not None:
                direct.reshape(-1).view(torch.uint8).copy_(payload)
            else:
                sink.land(payload)

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    t_relayout = _best(land, repeat)
    t_memcpy = _best(lambda: dst.copy_(src), repeat)
    bad = pattern.mismatch(rank.tensors, 1, d_ids, rank.coords, tokens)
    if bad:
        raise SystemExit(f"relayout bench produced wrong bytes for {pairing.name}: {bad}")
    return {
        "pairing": pairing.name,
        "bytes": nbytes,
        "relayout_gbps": nbytes / t_relayout / 1e9,
        "memcpy_gbps": nbytes / t_memcpy / 1e9,
        "ratio": t_memcpy / t_relayout,
    }


def run_bench(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    if "relayout" in args.sections:
        rows = []
        if not args.json:
            print(f"relayout: one request of {args.tokens} tokens, {args.layers} layers, {args.kv_heads} KV heads x {args.head_size} bf16, vs memcpy of the same bytes")
            print(f"  {'pairing':<40} {'MB':>8} {'relayout GB/s':>14} {'memcpy GB/s':>12} {'ratio':>6}")
        for pairing in RELAYOUT_PAIRINGS:
            row = bench_relayout(pairing, layers=args.layers, heads=args.kv_heads, head_size=args.head_size, tokens=args.tokens, repeat=args.repeat)
            rows.append(row)
            if not args.json:
                print(f"  {row['pairing']:<40} {row['bytes'] / 1e6:8.1f} {row['relayout_gbps']:14.2f} {row['memcpy_gbps']:12.2f} {row['ratio']:6.2f}", flush=True)
        results["relayout"] = rows
        results["relayout_vs_memcpy_min"] = min(float(r["ratio"]) for r in rows)
        if not args.json:
            print(f"  worst relayout / memcpy ratio: {results['relayout_vs_memcpy_min']:.2f} (target >= 0.5)")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--sections", nargs="+", default=["relayout"], choices=["relayout"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
