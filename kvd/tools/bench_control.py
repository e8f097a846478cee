"""``kvd bench --sections control``: what kvd's control plane costs per
request as requests grow, from 1k to 100k blocks.

One request's whole control path, in process and without a network, so
that only kvd's own work is timed: P's publish (the message and the lease
table's checks), D's pull message and its plan (topology, extents,
segments), the owner's authorisation of every read (capability, lease, each
block), and every read's READ message both ways. Finished-set aggregation
is per request, not per block, so it does not grow with blocks at all.

Three figures come out: how the per-block cost grows from 1k to 100k blocks
(linear means a ratio near 1), and the control path of a 128k-token request
of 16-token blocks against its transfer time on the wire: the best plain
socket the transport section measured in the same round (or memcpy speed
when it did not run), not kvd's own TCP rate, which would flatter a slow
data path. That request is planned as a daemon plans the transfer it is
compared with: over TCP between caches of one layout, whose bytes land in
place, in ``IN_PLACE_SEGMENT_BYTES`` segments. The third is the same request
in the ``DEFAULT_SEGMENT_BYTES`` segments of a read that stages and relays
out (eight times the segments, each with its READ entry and its checks),
held to the same limit.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.convert import (
    publish_from_pb,
    publish_to_pb,
    pull_from_pb,
    pull_to_pb,
    read_from_pb,
    read_to_pb,
)
from kvd.core.leases import PublicationTable
from kvd.core.owner import Owner
from kvd.core.reads import Offer
from kvd.core.requests import Blocks, PublishOrder, PullOrder, TransferParams
from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo, WorkerId
from kvd.core.transfer import DEFAULT_SEGMENT_BYTES, IN_PLACE_SEGMENT_BYTES, plan_pull
from kvd.testing.sim import SimEngine, make_engine

SIZES = (1_000, 10_000, 100_000)
LONG_TOKENS, LONG_BLOCK = 128 * 1024, 16


def _engines(blocks: int, *, layers: int, heads: int, head_size: int, block_size: int) -> tuple[SimEngine, SimEngine]:
    rng = random.Random(0)
    model = ModelInfo(layers, heads)

    def spec(_rank: int) -> KVCacheSpec:
        return KVCacheSpec(block_size, heads, head_size, "bfloat16", NAMED_LAYOUTS["NHD"], blocks + 1)

    # Memory left untouched (planning never reads it): a 128k-token request's GiBs cost nothing.
    return (make_engine("P", 1, 1, model, spec, rng, fill=False), make_engine("D", 1, 1, model, spec, rng, fill=False))


def control_path(blocks: int, *, layers: int, heads: int, head_size: int, block_size: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> float:
    """Seconds kvd's control plane spends on one request of ``blocks`` scattered blocks."""
    p, d = _engines(blocks, layers=layers, heads=heads, head_size=head_size, block_size=block_size)
    rng = np.random.default_rng(0)
    p_ids = (rng.permutation(blocks) + 1).tolist()  # scattered: no extent coalesces
    d_ids = (rng.permutation(blocks) + 1).tolist()
    num_tokens = blocks * block_size
    p_rank, d_rank = p.ranks[(0, 0)], d.ranks[(0, 0)]
    owner = Owner("P", "host", PublicationTable(60.0, "e"), same_host=False, max_segments_per_read=1 << 20)
    reader = owner.reader_joined(d.meta, 0.0)
    t0 = time.perf_counter()
    # P's worker publishes: its message, as the daemon's edge converts it, then the lease table's checks.
    msg = publish_to_pb(PublishOrder("r", (Blocks(tuple(p_ids)),), num_tokens, capability=b"c" * 32, worker=WorkerId("P")))
    got = publish_from_pb(type(msg).FromString(msg.SerializeToString()))
    pub, _ = owner.publish((0, 0), got.request_id, [np.asarray(b.ids, dtype=np.int64) for b in got.block_ids], [p_rank.tensors],
                           got.num_tokens, 0.0, capability=got.capability)
    # D's worker pulls with P's params; D's daemon plans.
    params = TransferParams("P", "p:1", "r", got.capability, got.block_ids, num_tokens, generation=pub.generation)
    sent = pull_to_pb(PullOrder(WorkerId("D"), "r", params, (Blocks(tuple(d_ids)),)))
    pull = pull_from_pb(type(sent).FromString(sent.SerializeToString()))
    offer: Offer = pull.params.offer()
    reads = plan_pull(local_meta=d.meta, local_tp_rank=0, local_pp_rank=0, local_groups=[d_rank.tensors], local_group_specs=[d_rank.group],
                      remote=p.meta, params=offer, local_block_ids=[list(pull.local[0].ids)], segment_bytes=segment_bytes)
    # Every read crosses as a READ message, and the owner authorises it block by block.
    for rr in reads:
        wire = read_to_pb(rr.read)
        read = read_from_pb(type(wire).FromString(wire.SerializeToString()))
        owner.authorize(read, reader, [p_rank.tensors], 0.0)
    return time.perf_counter() - t0


def bench_control(*, layers: int, heads: int, head_size: int, repeat: int, wire_gbps: float | None,
                  say: Callable[[str], None]) -> dict[str, Any]:
    say(f"control plane: one request's publish, pull, plan, READ messages and authorisation, {layers} layers, in process")
    say(f"  {'blocks':>8} {'ms':>9} {'us per block':>13}")
    per_block: dict[int, float] = {}
    for n in SIZES:
        # Small blocks here (1 head of 8): the cost is per block, and 100k real blocks would not fit in memory.
        t = min(control_path(n, layers=layers, heads=1, head_size=8, block_size=LONG_BLOCK) for _ in range(repeat))
        per_block[n] = t / n
        say(f"  {n:>8} {t * 1e3:9.1f} {t / n * 1e6:13.2f}")
    # The long request in the model's real shape: its segments are what a real one plans.
    n_long = LONG_TOKENS // LONG_BLOCK
    def long_request(segment_bytes: int) -> float:
        return min(control_path(n_long, layers=layers, heads=heads, head_size=head_size, block_size=LONG_BLOCK, segment_bytes=segment_bytes)
                   for _ in range(repeat))

    t_long, t_staged = long_request(IN_PLACE_SEGMENT_BYTES), long_request(DEFAULT_SEGMENT_BYTES)
    nbytes = LONG_TOKENS * layers * 2 * heads * head_size * 2
    rate = wire_gbps or _memcpy_gbps()
    transfer_s = nbytes / (rate * 1e9)
    out: dict[str, Any] = {
        "control_ms": {str(n): per_block[n] * n * 1e3 for n in SIZES},
        "control_growth": per_block[SIZES[-1]] / per_block[SIZES[0]],
        "control_128k_ms": t_long * 1e3,
        "control_128k_transfer_ms": transfer_s * 1e3,
        "control_vs_transfer_128k": t_long / transfer_s,
        "control_128k_staged_ms": t_staged * 1e3,
        "control_vs_transfer_128k_staged": t_staged / transfer_s,
    }
    say(f"  growth: {out['control_growth']:.2f} x the per-block cost at {SIZES[-1]} blocks as at {SIZES[0]}")
    say(f"  a 128k-token request ({n_long} blocks of {LONG_BLOCK}, {nbytes / 2**30:.1f} GiB): control {t_long * 1e3:.1f} ms, "
        f"transfer {transfer_s * 1e3:.0f} ms at {rate:.2f} GB/s ({'the best plain socket, this round: the wire' if wire_gbps else 'memcpy: no transport section'}): "
        f"{out['control_vs_transfer_128k'] * 100:.1f}% (in {IN_PLACE_SEGMENT_BYTES >> 20} MiB segments, as it lands in place; "
        f"staged for a relayout, in {DEFAULT_SEGMENT_BYTES >> 20} MiB segments: {t_staged * 1e3:.1f} ms, "
        f"{out['control_vs_transfer_128k_staged'] * 100:.1f}%)")
    return out


def _memcpy_gbps() -> float:
    import torch

    src, dst = torch.ones(256 << 20, dtype=torch.uint8), torch.empty(256 << 20, dtype=torch.uint8)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return (256 << 20) / (time.perf_counter() - t0) / 1e9
