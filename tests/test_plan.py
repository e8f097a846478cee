import time

import numpy as np
import pytest

from kvd.core.errors import InvalidArgument
from kvd.core.plan import plan_extents


def units_moved(ext):
    return int((ext.n * ext.u).sum())


def test_contiguous_same_size_is_one_extent():
    ext = plan_extents(list(range(10, 20)), 16, list(range(100, 110)), 16, 160)
    assert len(ext) == 1
    assert ext.side(0, remote=True) == (10, 10, 0, 16)
    assert ext.side(0, remote=False) == (100, 10, 0, 16)


def test_runs_break_where_either_side_jumps():
    ext = plan_extents([1, 2, 3, 7, 8], 16, [5, 6, 9, 10, 11], 16, 80)
    sides = [(ext.side(i, True)[:2], ext.side(i, False)[:2]) for i in range(len(ext))]
    assert sides == [((1, 2), (5, 2)), ((3, 1), (9, 1)), ((7, 2), (10, 2))]


def test_merge_small_remote_into_big_local_with_partial_tail():
    # 70 tokens: remote 5 blocks of 16, local 2 blocks of 64 (the second holds 6 tokens... of 1 unit).
    ext = plan_extents([0, 1, 2, 3, 4], 16, [7, 8], 64, 70)
    assert units_moved(ext) == 5
    assert ext.side(0, remote=False) == (7, 1, 0, 64)  # local big block 7, all 4 units
    assert ext.side(0, remote=True) == (0, 4, 0, 16)
    assert ext.side(1, remote=False) == (8, 1, 0, 16)  # first unit of block 8
    assert ext.side(1, remote=True) == (4, 1, 0, 16)


def test_split_big_remote_into_small_local_scattered():
    ext = plan_extents([3], 64, [9, 2, 5, 6], 16, 64)
    # local blocks 9, 2 are singletons; 5,6 form a run within the remote block
    got = [(ext.side(i, True), ext.side(i, False)) for i in range(len(ext))]
    assert got == [((3, 1, 0, 16), (9, 1, 0, 16)), ((3, 1, 16, 16), (2, 1, 0, 16)), ((3, 1, 32, 32), (5, 2, 0, 16))]


def test_max_units_chunks_long_runs():
    ext = plan_extents(list(range(100)), 16, list(range(100)), 16, 1600, max_units=32)
    assert len(ext) == 4 and units_moved(ext) == 100
    assert [ext.side(i, True)[0] for i in range(4)] == [0, 32, 64, 96]


def test_too_few_block_ids_is_refused():
    with pytest.raises(InvalidArgument, match="remote block_ids"):
        plan_extents([1], 16, [1, 2], 16, 32)


def test_planning_64_layers_2000_blocks_is_fast():
    rng = np.random.default_rng(0)
    r = rng.permutation(4000)[:2000]
    lo = rng.permutation(4000)[:2000]
    t0 = time.perf_counter()
    ext = plan_extents(r, 16, lo, 16, 2000 * 16, max_units=256)
    elapsed = time.perf_counter() - t0
    assert units_moved(ext) == 2000
    assert elapsed < 0.5  # generous: it is numpy over 2000 ids (a few ms)


def _one_rank_read(segment_bytes: int = 1 << 20):
    """A read of one remote rank: 200 scattered blocks, about 52 MiB in 1 MiB segments."""
    import random

    from kvd.core.reads import Offer
    from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
    from kvd.core.transfer import plan_pull
    from kvd.testing.sim import make_engine

    rng = random.Random(3)
    model = ModelInfo(4, 8)
    p = make_engine("P", 1, 1, model, lambda r: KVCacheSpec(16, 8, 128, "bfloat16", NAMED_LAYOUTS["NHD"], 300), rng)
    d = make_engine("D", 1, 1, model, lambda r: KVCacheSpec(16, 8, 128, "bfloat16", NAMED_LAYOUTS["NHD"], 300), rng)
    p_ids, d_ids = rng.sample(range(1, 300), 200), rng.sample(range(1, 300), 200)
    params = Offer(request_id="r", generation=1, capability=b"", block_ids=(tuple(p_ids),), num_tokens=200 * 16)
    rank = d.ranks[(0, 0)]
    (rr,) = plan_pull(local_meta=d.meta, local_tp_rank=0, local_pp_rank=0, local_groups=[rank.tensors], local_group_specs=[rank.group],
                      remote=p.meta, params=params, local_block_ids=[d_ids], segment_bytes=segment_bytes)
    return rr


def test_a_retry_whose_plan_cuts_a_rank_otherwise_reads_it_again():
    """A retry reads only what did not land, by each read's key (rank, heads,
    stripe). A retry's plan may cut the rank otherwise (its segment size
    depends on whether the peer is mapped here): the same key then covers
    other blocks, so it is done only where its segments are the same. The
    control (helper-39's finding): by the key alone, stripe 0 of the new cut
    was taken as landed, and blocks attempt 1 never landed were reported as
    landed. A rank that landed whole stays whole however it is cut."""
    from kvd.core.pull import PullProgress, Striping

    first, other_cut = _one_rank_read(1 << 20), _one_rank_read(768 << 10)
    striping = Striping(2, 1)
    progress = PullProgress()
    assert progress.begin([first], striping) == [0, 1]
    progress.landed[0] = [True] * len(progress.reads[0].sinks)  # attempt 1: stripe 0 landed, stripe 1 failed
    assert progress.settle([0, 1]) == [0]
    assert progress.begin([first], striping) == [1]  # the same plan: only stripe 1 again
    assert progress.moved == progress.reads[0].nbytes
    todo = progress.begin([other_cut], striping)
    every = sorted(int(b) for s in other_cut.sinks for b in s.local_block_ids)
    assert todo == [0, 1] and progress.moved == 0
    assert progress.invalid_blocks(every) == sorted(set(every))  # were it to fail now: every block, none taken as landed
    # A rank whose every read landed is whole under any cut (the owner ended
    # it on the last ACK and would refuse it again): one stripe, then both.
    for stripes in (1, 2):
        progress = PullProgress()
        todo = progress.begin([first], Striping(stripes, 1))
        for i in todo:
            progress.landed[i] = [True] * len(progress.reads[i].sinks)
        assert progress.settle(todo) == todo
        assert progress.begin([other_cut], Striping(stripes, 1)) == [] and progress.invalid_blocks(every) == []


def test_a_retry_keeps_the_first_attempts_cut():
    """The owner counts a reader's ACKs of a rank against the stripes it
    first saw: a retry cut otherwise would end the rank early (a read still
    to come refused) or never (held to its lease's end); helper-42's
    finding. So the first attempt's segment size stands, and a rank with
    some stripes landed is not read same-host (one unstriped read) even if
    it is now mapped here. The control: the rank's plan as the retry's
    peer would have it, one read."""
    from kvd.core.pull import PullProgress, Striping

    progress = PullProgress()
    assert progress.cut(64 << 20) == 64 << 20  # nothing begun yet (an attempt that failed planning pins nothing)
    rr = _one_rank_read(progress.cut(1 << 20))
    striping = Striping(2, 1)
    assert progress.begin([rr], striping, segment_bytes=1 << 20) == [0, 1]
    assert progress.cut(64 << 20) == 1 << 20  # the first attempt that began its reads: its size stands
    progress.landed[0] = [True] * len(progress.reads[0].sinks)  # stripe 0 landed (and was ACKed), stripe 1 failed
    progress.settle([0, 1])
    now_mapped = frozenset({rr.read.rank})
    assert progress.begin([rr], striping, now_mapped) == [1] and rr.read.rank not in progress.local  # stripe 1 of 2 again, over TCP
    assert PullProgress().begin([rr], striping, now_mapped) == [0]  # the control: a fresh pull reads it whole, same-host


def test_stripe_cuts_a_read_into_runs_of_whole_segments_of_about_equal_bytes():
    from kvd.core.transfer import stripe

    rr = _one_rank_read()
    for k in (1, 2, 3, 7):
        parts = stripe(rr, k)
        assert len(parts) == min(k, len(rr.sinks))
        assert [s for part in parts for s in part.read.segments] == list(rr.read.segments)
        assert [s for part in parts for s in part.sinks] == rr.sinks
        assert [(part.read.stripe, part.read.stripes) for part in parts] == ([(0, 0)] if k == 1 else [(i, len(parts)) for i in range(len(parts))])
        sizes = [part.nbytes for part in parts]
        assert sum(sizes) == rr.nbytes
        assert max(sizes) - min(sizes) <= max(s.nbytes for s in rr.sinks)  # balanced to one segment
        assert all(part.read.request_id == "r" and part.read.capability == rr.read.capability for part in parts)


def test_a_capped_read_is_cut_into_as_many_stripes_as_keep_each_within_the_cap():
    """--qos on: D gives its connections to reads in the wire's order, and a
    read keeps its connection to its end, so none may be much bigger than
    ``max_bytes`` (the order's grain); below ``min_bytes`` only the cap cuts."""
    from kvd.core.pull import PullProgress, Striping
    from kvd.core.reads import MAX_STRIPES

    rr = _one_rank_read()
    segment = max(s.nbytes for s in rr.sinks)
    n = rr.nbytes
    assert Striping(2, n + 1).of(rr) == 1 and Striping(2, n).of(rr) == 2  # as before: a big read over two connections
    assert Striping(2, n + 1, n).of(rr) == 1 and Striping(2, n, n // 4).of(rr) == 4 and Striping(2, n + 1, n // 4 - 1).of(rr) == 5
    assert Striping(2, 1, n // 1000).of(rr) == MAX_STRIPES  # no more than an owner takes
    progress = PullProgress()
    todo = progress.begin([rr], Striping(2, n, n // 4))
    assert len(todo) == 4 and all(part.nbytes <= n // 4 + segment for part in progress.reads)  # whole segments: within one of the cap
    assert sum(part.nbytes for part in progress.reads) == n
    assert progress.begin([rr], Striping(2, n, n // 4), frozenset({rr.read.rank})) == [0]  # a same-host copy is not cut


def test_reads_of_an_owner_that_counts_acks_the_old_way_are_not_cut_by_the_cap():
    """The cap makes each reader's count of reads depend on its own bytes, so
    readers of one rank differ; an owner without ``PER_READER_ACKS`` (kvd
    0.2.0) counted their ACKs against the stripes of whichever read ACKed
    last and could end the rank a stripe early. Its reads get whole stripes,
    as before the cap; a current owner's are cut."""
    from kvd.core.engine_meta import LAYER_STREAM, PER_READER_ACKS
    from kvd.core.pull import Striping

    rr = _one_rank_read()
    n = rr.nbytes
    capped = Striping(2, n, n // 4)
    assert capped.for_owner((LAYER_STREAM, PER_READER_ACKS)).of(rr) == 4
    assert capped.for_owner((LAYER_STREAM,)).of(rr) == 2 and capped.for_owner(()).of(rr) == 2
    assert Striping(2, n).for_owner(()) == Striping(2, n)  # nothing to drop


def test_an_engine_shape_is_memoised_by_identity_never_shared_between_metas():
    """``engine_shape`` keeps the shapes of the metas a daemon holds; another
    meta (an engine that re-registered, another peer) gets its own, past the
    memo's bound too."""
    import random

    from kvd.core import pairing
    from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
    from kvd.testing.sim import make_engine

    model, rng = ModelInfo(4, 8), random.Random(0)
    metas = [make_engine(f"e{i}", tp, pp, model, lambda r, tp=tp: KVCacheSpec(16, 8 // tp, 64, "bfloat16", NAMED_LAYOUTS["NHD"], 8), rng,
                         fill=False).meta
             for i, (tp, pp) in enumerate([(1, 1), (2, 1), (1, 2), (2, 2)] * 20)]
    for _ in range(2):  # the second pass reads the memo where it still holds them, and refills it where it was cleared
        for meta in metas:
            shape = pairing.engine_shape(meta)
            assert shape == pairing._engine_shape(meta), meta.engine_id
            assert (shape.tp_size, shape.pp_size) == (meta.tp_size, meta.pp_size)
    assert pairing.engine_shape(metas[-1]) is pairing.engine_shape(metas[-1])  # a hit: the very same shape
    assert len(pairing._SHAPES) <= pairing._SHAPES_KEPT


@pytest.mark.parametrize("d_ids", [[5, 6, 7, 8, 9, 10], [9, 2, 7, 4, 11, 6]], ids=["local run", "local scatter"])
def test_scattered_remote_blocks_onto_a_local_run_land_by_a_slice_copy_exactly(d_ids):
    """P's blocks scattered, D's one run, and a relayout (HND -> NHD): the
    batch lands by a slice copy of the run, not a scatter (the control: D's
    blocks scattered keep the scatter). Both land every byte exactly, and
    a sink aimed one block off is caught by the same check."""
    import dataclasses
    import random

    from kvd.core.pieces import serve_segment
    from kvd.core.reads import Offer
    from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
    from kvd.core.transfer import plan_pull
    from kvd.testing import pattern
    from kvd.testing.sim import make_engine
    from kvd.transport.base import Staging

    model = ModelInfo(2, 4)
    p = make_engine("P", 1, 1, model, lambda r: KVCacheSpec(16, 4, 8, "bfloat16", NAMED_LAYOUTS["HND"], 16), random.Random(1))
    p_ids = [12, 3, 8, 1, 14, 5]
    for r in p.ranks.values():
        pattern.fill(r.tensors, 7, p_ids, r.coords)

    def land(shift: int) -> str | None:
        d = make_engine("D", 1, 1, model, lambda r: KVCacheSpec(16, 4, 8, "bfloat16", NAMED_LAYOUTS["NHD"], 16), random.Random(2))
        rank = d.ranks[(0, 0)]
        reads = plan_pull(local_meta=d.meta, local_tp_rank=0, local_pp_rank=0, local_groups=[rank.tensors], local_group_specs=[rank.group],
                          remote=p.meta, params=Offer("r", 1, b"", (tuple(p_ids),), 96), local_block_ids=[d_ids])
        for rr in reads:
            for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
                assert seg.block_ids, "P's scattered blocks are batched"
                assert sink.local_run == (d_ids == sorted(d_ids)), "a run lands by slice, a scatter by index"
                if shift:
                    sink = dataclasses.replace(sink, local_block=(sink.local_block[0] + shift, sink.local_block[1]))
                sink.put(serve_segment(p.ranks[(0, 0)].tensors, seg, *rr.read.heads_of(seg), Staging()).clone())
        return pattern.mismatch(rank.tensors, 7, d_ids, rank.coords, 96)

    assert land(0) is None
    if d_ids == sorted(d_ids):
        assert land(1) is not None  # the negative control: one block off is caught


@pytest.mark.parametrize("p_ids", [[12, 3, 8, 1], [3, 4, 5, 6]], ids=["batched", "one run"])
def test_segments_of_one_shape_share_their_copies_and_land_each_at_its_own_blocks(p_ids, monkeypatch):
    """Requests of one shape land through one cached copy template (worked
    out for the first, moved to each request's own local blocks): every
    request lands exactly. The control: a template that is not moved to a
    request's blocks lands the later requests over the first one's, caught."""
    import random

    from kvd.core import sinks
    from kvd.core.pieces import serve_segment
    from kvd.core.reads import Offer
    from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
    from kvd.core.transfer import plan_pull
    from kvd.testing import pattern
    from kvd.testing.sim import make_engine
    from kvd.transport.base import Staging

    model = ModelInfo(2, 4)
    p = make_engine("P", 1, 1, model, lambda r: KVCacheSpec(16, 4, 8, "bfloat16", NAMED_LAYOUTS["HND"], 16), random.Random(1))
    for r in p.ranks.values():
        pattern.fill(r.tensors, 7, p_ids, r.coords)
    runs = [[1, 2, 3, 4], [9, 10, 11, 12], [5, 6, 7, 8]]

    def land() -> list[str | None]:
        d = make_engine("D", 1, 1, model, lambda r: KVCacheSpec(16, 4, 8, "bfloat16", NAMED_LAYOUTS["NHD"], 16), random.Random(2))
        rank = d.ranks[(0, 0)]
        for d_ids in runs:
            reads = plan_pull(local_meta=d.meta, local_tp_rank=0, local_pp_rank=0, local_groups=[rank.tensors], local_group_specs=[rank.group],
                              remote=p.meta, params=Offer("r", 1, b"", (tuple(p_ids),), 64), local_block_ids=[d_ids])
            for rr in reads:
                for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
                    sink.put(serve_segment(p.ranks[(0, 0)].tensors, seg, *rr.read.heads_of(seg), Staging()).clone())
        assert sum(1 for k in rank.tensors.templates if k[0] == "copies") >= 1, "the copies' template is cached on the group"
        return [pattern.mismatch(rank.tensors, 7, d_ids, rank.coords, 64) for d_ids in runs]

    assert land() == [None, None, None]
    unmoved = sinks.CopyTemplate.at
    monkeypatch.setattr(sinks.CopyTemplate, "at", lambda self, payload, run: unmoved(self, payload, (self.block, run[1])))
    assert all(bad is not None for bad in land()[1:])


def test_a_copy_template_is_not_moved_past_the_caches_blocks():
    """A run moved past the cache's last block is no view of it: torch's
    as_strided checks only the memory underneath, which for stacked layers
    goes on into the next layer. The template declines such a run (the
    copies made from scratch then refuse it)."""
    import torch

    from kvd.core.relayout import Copy
    from kvd.core.sinks import CopyTemplate

    cache = torch.zeros(2, 8, 4, dtype=torch.uint8)  # 2 layers of 8 blocks of 4 bytes
    payload = torch.arange(8, dtype=torch.uint8)
    template = CopyTemplate.of([(Copy(cache[0, 2:4], payload.view(2, 4)), 4)], (2, 2), 8, payload)
    assert template is not None
    for c in template.at(payload, (6, 2)):  # the last two blocks of layer 0
        c.run()
    assert cache[0, 6:].flatten().tolist() == list(range(8)) and not cache[1].any()
    assert template.at(payload, (7, 2)) is None  # one past them: it would have written layer 1's block 0
    assert template.at(payload, (-1, 2)) is None
