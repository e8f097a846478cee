"""The verification digest (kvd/core/digest.py): P's and D's sums agree across
layouts, block sizes, TP splits and PP stages, and each corruption kvd must
catch changes exactly the reader's blocks that hold it."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvd.core.digest import (
    DigestQuery,
    DigestRows,
    Mismatch,
    RowDigests,
    RowSample,
    answer,
    compare,
)
from kvd.core.errors import InvalidArgument
from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
from kvd.core.topology import heads_of_rank
from kvd.testing import pattern
from kvd.testing.sim import SimEngine, make_engine, transfer

MODEL = ModelInfo(4, 4)
TOKENS = 150  # 5 of P's 32-token blocks, the last part full; 10 of D's 16-token ones


def engine(name: str, tp: int, pp: int, block: int, layout: str, seed: int, **kw) -> SimEngine:
    return make_engine(name, tp, pp, MODEL, lambda r: KVCacheSpec(block, 4 // tp, 16, "bfloat16", NAMED_LAYOUTS[layout], 24), random.Random(seed), **kw)


def side_bins(e: SimEngine, ids: list[int], first: int, heads: range, layers: Sequence[int], sample: RowSample, bin_tokens: int) -> np.ndarray:
    """An engine's answer to a reader asking for the rows ``heads`` x ``layers`` (each counted once)."""
    held = [[RowDigests.of(rank.tensors, 0, ids, 0, TOKENS, heads_of_rank(tp, e.meta.tp_size, MODEL.total_num_kv_heads, False).start, sample, 4, 4)]
            for (tp, _pp), rank in sorted(e.ranks.items())]
    query = DigestQuery("P", "r", 1, b"", (DigestRows(0, tuple(layers), heads, first, TOKENS, bin_tokens),))
    return answer(query, sample, held).sums[0]


@pytest.fixture
def pd():
    p = engine("P", 1, 1, 32, "HND", 1, shuffle_memory=True)
    p_ids = [7, 2, 11, 4, 9]
    for r in p.ranks.values():
        pattern.fill(r.tensors, 5, p_ids, r.coords)
    d = engine("D", 2, 2, 16, "NHD", 2, stacked=False)
    d_ids = [3, 17, 5, 9, 12, 1, 20, 8, 14, 6]
    transfer(p, d, "r", p_ids, d_ids, TOKENS)
    return p, p_ids, d, d_ids


def layer_view(rank, li: int):
    """One layer's canonical (kv, block, token, head, dim) view, layers stacked or not."""
    view = rank.tensors.parts[0]
    return view[li] if isinstance(view, torch.Tensor) else view[li][0]


def d_rank_check(p, p_ids, d, d_ids, sample: RowSample, first: int = 0) -> dict[tuple[int, int], object]:
    """Per D rank: where its digest of tokens from ``first`` differs from P's (None: nowhere)."""
    out = {}
    for (tp, pp), rank in d.ranks.items():
        mine = heads_of_rank(tp, 2, 4, False)
        layers = rank.group.layer_indices
        theirs = side_bins(p, p_ids, first, range(mine.start, mine.stop), layers, sample, 16)
        ours = RowDigests.of(rank.tensors, 0, d_ids, 0, TOKENS, mine.start, sample, 4, 4).bins(layers, range(0, 4), first, TOKENS, 16)
        out[(tp, pp)] = compare(layers, ours, theirs)
    return out


@pytest.mark.parametrize("per_window", [0, 2, 8])
def test_a_relaid_out_copy_digests_as_the_original_on_every_rank(pd, per_window):
    """P TP1 HND 32-token blocks, memory in shuffled dim order; D TP2 x PP2 NHD 16-token blocks, layers unstacked."""
    p, p_ids, d, d_ids = pd
    sample = RowSample(seed=0xC0FFEE, per_window=per_window)
    assert all(m is None for m in d_rank_check(p, p_ids, d, d_ids, sample).values())
    assert all(m is None for m in d_rank_check(p, p_ids, d, d_ids, sample, first=64).values())  # a reader's prefix hit
    # Not vacuous: the sums are not zero, and another seed gives others.
    rank = d.ranks[(0, 0)]
    a = RowDigests.of(rank.tensors, 0, d_ids, 0, TOKENS, 0, sample, 4, 4).bins((0, 1), range(0, 2), 0, TOKENS, 16)
    b = RowDigests.of(rank.tensors, 0, d_ids, 0, TOKENS, 0, RowSample(1, per_window), 4, 4).bins((0, 1), range(0, 2), 0, TOKENS, 16)
    assert a.any() and np.any(a != b)


def test_a_flipped_byte_marks_exactly_its_readers_block(pd):
    p, p_ids, d, d_ids = pd
    rank = d.ranks[(1, 1)]
    view = layer_view(rank, 0)  # layer 2, the stage's first
    view[1, d_ids[6], 3, 1, 5] ^= 0x10  # V, the 7th block (tokens 96..111), slot 3, local head 1
    bad = d_rank_check(p, p_ids, d, d_ids, RowSample(9))
    assert bad.pop((1, 1)) == Mismatch(bins=(6,), first_layer=2, first_bin=6)
    assert all(m is None for m in bad.values())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_big_blocks_hashed_where_they_lie_digest_as_small_ones_gathered(layout):
    """P's blocks of 256 tokens x 4 heads x 128 (256 KiB a layer and plane:
    hashed in place, HND's rows in memory in (head, token) order) against D's
    TP2 64-token blocks (gathered a chunk at a time): every row agrees; one
    flipped byte in P's third block fails exactly the D block that holds it."""
    big = ModelInfo(4, 4)
    p = make_engine("P", 1, 1, big, lambda r: KVCacheSpec(256, 4, 128, "bfloat16", NAMED_LAYOUTS[layout], 6), random.Random(1), stacked=layout == "NHD")
    d = make_engine("D", 2, 1, big, lambda r: KVCacheSpec(64, 2, 128, "bfloat16", NAMED_LAYOUTS["NHD"], 16), random.Random(2))
    tokens, p_ids, d_ids = 700, [4, 1, 3], [9, 2, 14, 5, 11, 7, 1, 12, 3, 15, 6]
    for r in p.ranks.values():
        pattern.fill(r.tensors, 5, p_ids, r.coords)
    transfer(p, d, "r", p_ids, d_ids, tokens)

    def check() -> dict[int, object]:
        sample, out = RowSample(77), {}
        held = [[RowDigests.of(p.ranks[(0, 0)].tensors, 0, p_ids, 0, tokens, 0, sample, 4, 4)]]
        for (tp, _pp), rank in d.ranks.items():
            heads = heads_of_rank(tp, 2, 4, False)
            query = DigestQuery("P", "r", 1, b"", (DigestRows(0, (0, 1, 2, 3), range(heads.start, heads.stop), 0, tokens, 64),))
            ours = RowDigests.of(rank.tensors, 0, d_ids, 0, tokens, heads.start, sample, 4, 4).bins((0, 1, 2, 3), heads, 0, tokens, 64)
            out[tp] = compare((0, 1, 2, 3), ours, answer(query, sample, held).sums[0])
        return out

    assert check() == {0: None, 1: None}
    layer_view(p.ranks[(0, 0)], 2)[0, p_ids[2], 130, 3, 77] += 1  # K, tokens 512..767, its token 642, head 3: D rank 1's
    assert check() == {0: None, 1: Mismatch(bins=(10,), first_layer=2, first_bin=10)}


def test_two_heads_swapped_by_a_relayout_bug_are_caught(pd):
    """Same values, wrong place: a sum over the block alone would not see it."""
    p, p_ids, d, d_ids = pd
    view = layer_view(d.ranks[(0, 0)], 1)
    block = d_ids[2]
    h0 = view[:, block, :, 0].clone()
    view[:, block, :, 0] = view[:, block, :, 1]
    view[:, block, :, 1] = h0
    assert d_rank_check(p, p_ids, d, d_ids, RowSample(3))[(0, 0)] == Mismatch(bins=(2,), first_layer=1, first_bin=2)


def test_a_block_p_reused_after_publishing_is_caught_by_the_sample(pd):
    """P writes another request's tokens into a published block after D read
    it: a sample of 16 rows a window finds it on every D rank, in those
    blocks only (P's 4th block is D's 7th and 8th)."""
    p, p_ids, d, d_ids = pd
    for r in p.ranks.values():
        pattern.fill(r.tensors, 6, [p_ids[3]], r.coords, first_token=96)
    bad = d_rank_check(p, p_ids, d, d_ids, RowSample(11, per_window=16))
    assert all(m is not None and set(m.bins) <= {6, 7} for m in bad.values()), bad
    assert set().union(*(m.bins for m in bad.values() if m is not None)) == {6, 7}


def test_a_systematic_relayout_bug_is_caught_by_the_default_sample_on_the_first_request():
    """A relayout that swaps two heads in every block (the bug sampled mode
    is for) is caught by the daemon's sample (2 rows a window) for every
    seed tried: every one of 20 requests finds it, on every D rank."""
    p = engine("P", 1, 1, 16, "NHD", 1)
    ids = list(range(1, 11))
    for r in p.ranks.values():
        pattern.fill(r.tensors, 5, ids, r.coords)
    d = engine("D", 2, 1, 16, "NHD", 2)
    transfer(p, d, "r", ids, ids, TOKENS)
    for rank in d.ranks.values():
        for li in range(len(rank.group.layer_indices)):
            view = layer_view(rank, li)
            view[:, :, :, [0, 1]] = view[:, :, :, [1, 0]].clone()
    for seed in range(20):
        found = d_rank_check(p, ids, d, ids, RowSample(1000 + seed, per_window=2))
        assert all(m is not None for m in found.values()), (seed, found)
    # The control: the same check of an untouched copy finds nothing.
    clean = engine("D", 2, 1, 16, "NHD", 2)
    transfer(p, clean, "r", ids, ids, TOKENS)
    assert all(m is None for m in d_rank_check(p, ids, clean, ids, RowSample(1000, per_window=2)).values())


def digested_rows(d: RowDigests) -> list[tuple[int, int, int, int]]:
    """A sampled digest's (layer, token, head, value) rows, in one order."""
    return sorted(zip(np.asarray(d.layers)[d.layer_pos].tolist(), d.tokens.tolist(), d.heads.tolist(), d.values.tolist(), strict=True))


def test_a_sample_that_draws_no_row_of_some_layers_digests_the_rest():
    """32 unstacked layers and a 32-token prompt: 4 draws, so most layers
    hold no sampled row. Both sides digest what was drawn, alike."""
    model = ModelInfo(32, 4)

    def make(name, seed, **kw):
        return make_engine(name, 1, 1, model, lambda r: KVCacheSpec(16, 4, 16, "bfloat16", NAMED_LAYOUTS["NHD"], 8), random.Random(seed), **kw)

    p, d = make("P", 1), make("D", 2, stacked=False)
    for r in p.ranks.values():
        pattern.fill(r.tensors, 5, [1, 2], r.coords)
    transfer(p, d, "r", [1, 2], [3, 4], 32)
    sample = RowSample(21, per_window=2)
    ours = RowDigests.of(d.ranks[(0, 0)].tensors, 0, [3, 4], 0, 32, 0, sample, 4, 32)
    theirs = RowDigests.of(p.ranks[(0, 0)].tensors, 0, [1, 2], 0, 32, 0, sample, 4, 32)
    # The same rows and values; their order is each side's own (drawn, or layer by layer where a cache's layers are unstacked).
    assert 0 < len(set(ours.layer_pos.tolist())) < 32 and digested_rows(ours) == digested_rows(theirs)
    layers = tuple(range(32))
    assert compare(layers, ours.bins(layers, range(0, 4), 0, 32, 16), theirs.bins(layers, range(0, 4), 0, 32, 16)) is None


def test_bad_input_is_refused_naming_the_field():
    with pytest.raises(InvalidArgument, match=r"verify\.per_window"):
        RowSample(1, per_window=256)
    with pytest.raises(InvalidArgument, match=r"verify\.seed"):
        RowSample(-1)
    with pytest.raises(InvalidArgument, match=r"verify\.digests"):
        compare((0,), np.zeros((1, 3), np.uint64), np.zeros((1, 4), np.uint64))


def test_replicated_heads_and_stages_count_once():
    """P TP4 x PP2 over 2 KV heads: each head on two ranks (replicas) and
    each layer on one stage; its answer equals one TP1 engine's, so no row
    is counted twice or left out."""
    def filled(tp, pp, seed):
        e = make_engine("P", tp, pp, ModelInfo(4, 2), lambda r: KVCacheSpec(32, max(1, 2 // tp), 16, "bfloat16", NAMED_LAYOUTS["NHD"], 24),
                        random.Random(seed))
        for r in e.ranks.values():
            pattern.fill(r.tensors, 5, [1, 2, 3, 4, 5], r.coords)
        return e

    query = DigestQuery("P", "r", 1, b"", (DigestRows(0, (0, 1, 2, 3), range(0, 2), 0, TOKENS, 64),))

    def ask(e, sample):
        held = [[RowDigests.of(r.tensors, 0, [1, 2, 3, 4, 5], 0, TOKENS, heads_of_rank(tp, e.meta.tp_size, 2, False).start, sample, 2, 4)]
                for (tp, _pp), r in sorted(e.ranks.items())]
        return answer(query, sample, held).sums[0]

    one, many = filled(1, 1, 1), filled(4, 2, 2)
    for sample in (RowSample(77), RowSample(77, 3)):
        assert np.array_equal(ask(one, sample), ask(many, sample))
    assert np.all(ask(one, RowSample(77)) != 0) and ask(one, RowSample(77, 3)).any()


def test_a_sample_draws_its_rows_of_every_window_whatever_the_range():
    """Both sides draw the same rows from the seed alone, for any range and
    layers and heads that hold them; every aligned 16 positions draw exactly
    per_window rows; full takes every row."""
    s = RowSample(123, per_window=3)
    lpos, tokens, heads = s.rows(0, range(12), 0, 160, range(0, 8), 8, 12)  # every layer and head: every draw
    assert np.array_equal(np.bincount(tokens // 16, minlength=10), [3] * 10) and np.all(np.diff(lpos) >= 0)
    assert len(set(lpos.tolist())) > 6 and len(set(heads.tolist())) > 4  # layers and heads are drawn
    part = s.rows(0, (5, 9), 37, 150, range(2, 6), 8, 12)  # another rank's layers, tokens and heads
    keep = np.isin(lpos, (5, 9)) & (tokens >= 37) & (tokens < 150) & (heads >= 2) & (heads < 6)
    order = np.argsort(lpos[keep], kind="stable")
    assert np.array_equal(part[1], tokens[keep][order]) and np.array_equal(part[2], heads[keep][order])
    assert np.array_equal(part[0], np.searchsorted([5, 9], lpos[keep][order]))
    other = RowSample(124, per_window=3).rows(0, range(12), 0, 160, range(0, 8), 8, 12)
    assert not (np.array_equal(other[1], tokens) and np.array_equal(other[2], heads))  # the seed decides
    lpos, tokens, heads = RowSample(1).rows(0, (3,), 5, 7, range(2, 4), 4, 4)  # full: every row, (token, head) order
    assert lpos.tolist() == [0] * 4 and tokens.tolist() == [5, 5, 6, 6] and heads.tolist() == [2, 3, 2, 3]


def test_an_answer_missing_a_rank_is_no_answer(pd):
    """A rank that holds asked heads and has not been digested (not yet
    published) makes no partial sum: a reader would fail good blocks."""
    p, p_ids, _d, _d_ids = pd
    rank = p.ranks[(0, 0)]
    full = [RowDigests.of(rank.tensors, 0, p_ids, 0, TOKENS, 0, RowSample(3), 4, 4)]
    query = DigestQuery("P", "r", 1, b"", (DigestRows(0, (0, 1), range(0, 4), 0, TOKENS, 16),))
    assert answer(query, RowSample(3), [full]) is not None
    assert answer(query, RowSample(3), []) is None
    narrow = DigestQuery("P", "r", 1, b"", (DigestRows(0, (0, 1), range(0, 6), 0, TOKENS, 16),))  # heads 4, 5 held nowhere
    assert answer(narrow, RowSample(3), [full]) is None


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("per_window", [2, 0])
def test_a_plan_made_before_the_bytes_land_digests_them_as_they_are_when_read(stacked, per_window):
    """A reader plans its check while its bytes travel (RowPlan): the plan
    reads nothing, so its digest is of the bytes at digest time, as one made
    then; and bytes that change after planning change it (the control)."""
    from kvd.core.digest import RowPlan

    e = engine("D", 1, 1, 16, "NHD", 4, stacked=stacked)
    rank = e.ranks[(0, 0)]
    ids, sample = [3, 7, 5, 1, 9, 2, 8, 4, 6, 10], RowSample(11, per_window)
    pattern.fill(rank.tensors, 1, ids, rank.coords)  # what was there before the pull
    plan = RowPlan.of(rank.tensors, 0, ids, 0, TOKENS, 0, sample, 4, 4)
    before = plan.digest().values.copy()
    pattern.fill(rank.tensors, 2, ids, rank.coords)  # what landed
    landed = RowDigests.of(rank.tensors, 0, ids, 0, TOKENS, 0, sample, 4, 4)
    assert np.array_equal(plan.digest().values, landed.values)
    assert not np.array_equal(before, landed.values)


def test_a_big_block_not_on_a_whole_word_is_hashed_as_an_aligned_copy_of_it():
    """A block hashed where it lies is read as 8-byte words, which needs it to
    start on one: a cache that starts 2 bytes into its memory (a state packed
    after another) is gathered instead, and hashes as the same bytes aligned."""
    import torch

    from kvd.core.row_hash import hash_blocks, row_keys

    blocks, shape = 3, (256, 4, 128)  # 256 KiB of bf16 a block: big enough to hash in place
    numel = blocks * 256 * 4 * 128
    raw = torch.empty(numel * 2 + 2, dtype=torch.uint8)
    shifted = raw[2:].view(torch.bfloat16).view(blocks, *shape)
    shifted.view(torch.int16).copy_(torch.randint(-2**15, 2**15, (blocks, *shape), dtype=torch.int16))
    aligned = shifted.clone()
    assert shifted.storage_offset() * 2 % 8 and not aligned.storage_offset()
    keys = row_keys(5, 32)
    ours = hash_blocks(shifted, np.array([2, 0]), keys, torch.int64, [])
    assert np.array_equal(ours, hash_blocks(aligned, np.array([2, 0]), keys, torch.int64, []))
    assert len(ours) == 2 * 256 * 4 and len(set(ours.tolist())) == len(ours)
