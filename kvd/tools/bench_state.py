"""``kvd bench``'s hybrid shape: Mamba2 state moved across TP and conv layouts.

A model with state moves, per request and layer, one running state: each
conv sub-projection and the SSM state sliced by its own heads. This
prepares decode's landing of that state for a batch of requests (P TP2 with the SD conv
layout, D TP1 with DS: a head gather and a transpose in one strided copy);
``kvd bench`` times it against memcpy of the same bytes, as every other
relayout row, and checks every byte.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvd.core.pieces import serve_segment
from kvd.core.reads import Offer
from kvd.core.sinks import SegmentSink
from kvd.core.transfer import plan_pull
from kvd.state_parts import DS, SD, StateShape, mamba2
from kvd.testing import pattern
from kvd.testing.sim import make_state_engine
from kvd.transport.base import Staging

NAME = "Mamba2 state TP2 SD -> TP1 DS"


def state_work(*, layers: int, heads: int, head_size: int, requests: int) -> tuple[str, list[tuple[SegmentSink, torch.Tensor]], Callable[[], str | None]]:
    """The received segments of ``requests`` requests' state, in the demo's
    Mamba2 shape (twice ``heads`` SSM heads of ``head_size``, a group per KV
    head, d_state 16), and the check of what they land; ``kvd bench`` times
    them like any relayout."""
    def shape(layout: str) -> StateShape:
        return mamba2(num_heads=2 * heads, head_dim=head_size, n_groups=heads, d_state=16, conv_kernel=4, dtype="bfloat16",
                      ssm_dtype="float32", conv_layout=layout)

    layer_ids = tuple(range(layers))
    p_meta, p_ranks = make_state_engine("P", shape(SD), 2, layer_ids, requests + 1)
    d_meta, d_ranks = make_state_engine("D", shape(DS), 1, layer_ids, requests + 1)
    for tp, rank in enumerate(p_ranks):
        for t, c in zip(rank.tensors, rank.coords(tp), strict=True):
            for r in range(requests):
                pattern.fill(t, r, [r + 1], c)
    d = d_ranks[0]
    parts = len(d.groups)
    staging = Staging()
    work = []
    for r in range(requests):
        offer = Offer(f"r{r}", 1, b"", tuple((r + 1,) for _ in range(parts)), 100)
        reads = plan_pull(local_meta=d_meta, local_tp_rank=0, local_pp_rank=0, local_groups=d.tensors,
                          local_group_specs=d.groups, remote=p_meta, params=offer, local_block_ids=[[r + 1]] * parts)
        for rr in reads:
            owner = p_ranks[rr.read.tp_rank].tensors
            for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
                work.append((sink, serve_segment(owner[seg.group_id], seg, *rr.read.heads_of(seg), staging).clone()))

    def check() -> str | None:
        for r in range(requests):
            for g, t, c in zip(d.groups, d.tensors, d.coords(0), strict=True):
                bad = pattern.mismatch(t, r, [r + 1], c, g.spec.block_size)
                if bad:
                    return f"request {r}: {bad}"
        return None

    return f"{NAME}, {requests} req", work, check
