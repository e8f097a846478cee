"""Scattered blocks as memory pieces (what the NIXL path posts), without a network.

The owner's pieces (``batched_pieces``) and the reader's (``SegmentSink.batched_pieces``)
must pair one for one in wire order: copying piece i to piece i must leave the
reader's cache exactly as the gather-and-land path does.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

from kvd.core.pieces import batched_pieces, serve_segment
from kvd.core.reads import Offer
from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
from kvd.core.topology import heads_of_rank
from kvd.core.transfer import plan_pull
from kvd.testing import pattern
from kvd.testing.sim import make_engine
from kvd.transport.base import Staging


def _copy_pieces(src, dst, piece: int) -> None:
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        ctypes.memmove(d, s, piece)


@pytest.mark.parametrize("layout", ["NHD", "HND", "NHD_SPLIT", "HND_SPLIT", "NHD_BLOCKS_FIRST", "HND_BLOCKS_FIRST", "OPAQUE"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_owner_and_reader_pieces_pair_and_land_exactly(layout, stacked, p_tp, d_tp):
    rng = random.Random(7)
    heads, head_size, bs, layers = 4, 8, 16, 3
    opaque = layout == "OPAQUE"
    model = ModelInfo(layers, heads)

    def spec_of(tp: int):
        return lambda r: KVCacheSpec(bs, heads_of_rank(r, tp, heads, False).count, head_size, "float16", NAMED_LAYOUTS[layout], 64,
                                     span_size=2 * bs * head_size if opaque else 0)

    p = make_engine("P", p_tp, 1, model, spec_of(p_tp), rng, stacked=stacked)
    d = make_engine("D", d_tp, 1, model, spec_of(d_tp), rng, stacked=stacked)
    by_pieces = 0
    # Two requests on the same engines: the second reuses the piece templates
    # cached on the groups, with other block ids.
    for seed in (3, 4):
        p_ids, d_ids = rng.sample(range(1, 64), 20), rng.sample(range(1, 64), 20)
        for r in p.ranks.values():
            pattern.fill(r.tensors, seed, p_ids, r.coords)
        params = Offer(request_id="r", generation=1, capability=b"", block_ids=(tuple(p_ids),), num_tokens=20 * bs)
        for (tp, pp), rank in d.ranks.items():
            for rr in plan_pull(local_meta=d.meta, local_tp_rank=tp, local_pp_rank=pp, local_groups=[rank.tensors], local_group_specs=[rank.group],
                                remote=p.meta, params=params, local_block_ids=[d_ids], segment_bytes=1 << 16):
                owner = p.ranks[(rr.read.tp_rank, rr.read.pp_rank)]
                for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
                    src = batched_pieces(owner.tensors, seg, rr.read.head_start, rr.read.head_count)
                    dst = sink.batched_pieces()
                    if src is not None and dst is not None and len(src[0]) == len(dst[0]) and src[1] == dst[1]:
                        assert len(src[0]) * src[1] == sink.nbytes
                        _copy_pieces(src[0], dst[0], src[1])
                        by_pieces += 1
                        continue
                    payload = serve_segment(owner.tensors, seg, rr.read.head_start, rr.read.head_count, Staging())
                    if src is not None:  # the owner's pieces alone must still spell the wire bytes
                        buf = torch.empty(sink.nbytes, dtype=torch.uint8)
                        _copy_pieces(src[0], buf.data_ptr() + torch.arange(len(src[0])).numpy().astype("uint64") * src[1], src[1])
                        assert torch.equal(buf, payload)
                    direct = sink.direct()
                    if direct is not None:
                        direct.reshape(-1).view(torch.uint8).copy_(payload)
                    else:
                        sink.land(payload.clone())
            assert pattern.mismatch(rank.tensors, seed, d_ids, rank.coords, 20 * bs) is None
    if p_tp == d_tp:  # same layout, same heads: scattered blocks go piece to piece
        assert by_pieces > 0


def test_staging_is_reused_grows_and_lets_go_of_big_buffers():
    staging = Staging()
    first = staging(100)
    assert staging(50).data_ptr() == first.data_ptr()  # reused, not reallocated
    staging(1000)
    assert staging.nbytes == 1000
    staging.shrink(500)  # after a big read: back to the allocator
    assert staging.nbytes == 0
    staging(10)
    staging.shrink(500)  # small buffers stay
    assert staging.nbytes == 10


def test_a_contiguous_run_pairs_with_the_other_sides_pieces_for_the_device_copy() -> None:
    """The same-host GPU copy pairs pieces one for one: a contiguous run on
    one side is cut into the other side's pieces; byte counts that differ,
    or pieces that don't divide, pair with nothing."""
    from kvd.transport import device_pieces

    src_addrs = np.array([0, 8192, 4096, 12288], dtype=np.uint64) + np.uint64(2 << 20)
    found = device_pieces.pair((np.array([1 << 20], dtype=np.uint64), 4 * 4096), (src_addrs, 4096))
    assert found is not None
    dst, src, piece = found
    assert piece == 4096 and dst.tolist() == [(1 << 20) + i * 4096 for i in range(4)] and src.tolist() == src_addrs.tolist()
    assert device_pieces.pair((np.array([0], dtype=np.uint64), 3000), (np.array([0, 4096], dtype=np.uint64), 2048)) is None
    assert device_pieces.pair((np.array([0, 6144], dtype=np.uint64), 6144), (np.array([0, 4096, 8192], dtype=np.uint64), 4096)) is None
    assert not device_pieces.available(torch.device("cpu"))
