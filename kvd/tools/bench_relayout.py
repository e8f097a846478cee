"""The relayout section of ``kvd bench``: landing received bytes into a
different layout, block size or head slice (what D does after every receive),
against the best plain memcpy of the same bytes (1..cores threads)."""

from __future__ import annotations

import collections
import itertools
import random
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
from kvd.tools.bench_memcpy import BestMemcpy
from kvd.tools.bench_pair import best_seconds as _best
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
