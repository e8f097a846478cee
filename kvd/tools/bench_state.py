"""``kvd bench``'s hybrid shape: Mamba2 state moved across TP and conv layouts.

A model with state moves, per request and layer, one running state: each
conv sub-projection and the SSM state sliced by its own heads. This times
decode landing that state for a batch of requests (P TP2 with the SD conv
layout, D TP1 with DS: a head gather and a transpose in one strided copy),
against memcpy of the same bytes, and checks every byte.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvd.core.pieces import serve_segment
from kvd.core.reads import Offer
from kvd.core.transfer import plan_pull
from kvd.state_parts import DS, SD, mamba2
from kvd.testing import pattern
from kvd.testing.sim import make_state_engine
from kvd.transport.base import Staging

NAME = "Mamba2 state TP2 SD -> TP1 DS"


def bench_state(*, layers: int, heads: int, head_size: int, requests: int, repeat: int) -> dict[str, Any]:
    """The demo's Mamba2 shape: twice ``heads`` SSM heads of ``head_size``, a group per KV head, d_state 16."""
    def shape(layout: str):  # type: ignore[no-untyped-def]
        return mamba2(num_heads=2 * heads, head_dim=head_size, n_groups=heads, d_state=16, conv_kernel=4, dtype="bfloat16",
                      ssm_dtype="float32", conv_layout=layout)

    layer_ids = tuple(range(layers))
    p_meta, p_ranks = make_state_engine("P", shape(SD), 2, layer_ids, requests + 1)
    d_meta, d_ranks = make_state_engine("D", shape(DS), 1, layer_ids, requests + 1)
    for tp, rank in enumerate(p_ranks):
        for t, c in zip(rank.tensors, rank.coords(tp), strict=True):
            for r in range(requests):
                pattern.fill(t, r, [r + 1], c)
    parts = len(d_ranks[0].groups)
    staging = Staging()
    work = []
    for r in range(requests):
        offer = Offer(f"r{r}", 1, b"", tuple((r + 1,) for _ in range(parts)), 100)
        reads = plan_pull(local_meta=d_meta, local_tp_rank=0, local_pp_rank=0, local_groups=d_ranks[0].tensors,
                          local_group_specs=d_ranks[0].groups, remote=p_meta, params=offer, local_block_ids=[[r + 1]] * parts)
        for rr in reads:
            owner = p_ranks[rr.read.tp_rank].tensors
            for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
                work.append((sink, serve_segment(owner[seg.group_id], seg, *rr.read.heads_of(seg), staging).clone()))
    nbytes = sum(s.nbytes for s, _ in work)

    def best(fn) -> float:  # type: ignore[no-untyped-def]
        out = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    def land() -> None:
        for sink, payload in work:
            sink.land(payload)

    t_land = best(land)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    t_memcpy = best(lambda: dst.copy_(src))
    d = d_ranks[0]
    for r in range(requests):
        for g, t, c in zip(d.groups, d.tensors, d.coords(0), strict=True):
            bad = pattern.mismatch(t, r, [r + 1], c, g.spec.block_size)
            if bad:
                raise SystemExit(f"state bench produced wrong bytes: request {r}: {bad}")
    return {"pairing": f"{NAME}, {requests} req", "bytes": nbytes, "relayout_gbps": nbytes / t_land / 1e9,
            "memcpy_gbps": nbytes / t_memcpy / 1e9, "ratio": t_memcpy / t_land}
