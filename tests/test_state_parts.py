"""Mamba and linear-attention state, moved as state parts: each conv
sub-projection and the SSM state sliced by its own heads across TP, in any
conv layout, only the running state block, exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.errors import Incompatible, InvalidArgument
from kvd.core.pairing import check_compatible
from kvd.core.pieces import serve_segment
from kvd.core.reads import Offer
from kvd.core.spec import GroupSpec
from kvd.core.transfer import plan_pull
from kvd.state_parts import DS, SD, StateShape, gated_delta_net, mamba2
from kvd.testing import pattern
from kvd.testing.sim import make_state_engine
from kvd.transport.base import Staging

LAYERS = (0, 1)
NUM_BLOCKS = 6


def _engine(name: str, shape: StateShape, tp: int):
    meta, ranks = make_state_engine(name, shape, tp, LAYERS, NUM_BLOCKS)
    return meta, [(r.buffer, r.groups, r.tensors) for r in ranks]


def _coords(groups, tp_rank, tp_size):
    """Where each part's heads start in the model: an equal share a rank, or
    the one head a replicated part's rank holds (``total_heads``)."""
    return [pattern.RankCoords.of(tp_rank, tp_size, g.spec.total_heads or g.spec.num_kv_heads * tp_size, False) for g in groups]


def _move(p_meta, p_ranks, d_meta, d_ranks, p_block: int, d_block: int) -> int:
    n = len(p_ranks[0][1])
    offer = Offer("req", 1, b"", tuple((0, p_block) for _ in range(n)), 100)  # block 0 is an earlier, stale state
    moved = 0
    for tp, (_buf, groups, tensors) in enumerate(d_ranks):
        reads = plan_pull(local_meta=d_meta, local_tp_rank=tp, local_pp_rank=0, local_groups=tensors, local_group_specs=groups,
                          remote=p_meta, params=offer, local_block_ids=[[d_block]] * n)
        assert len({rr.read.rank for rr in reads}) == len(reads)  # one read per remote rank
        for rr in reads:
            owner = p_ranks[rr.read.tp_rank][2]
            for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
                sink.land(serve_segment(owner[seg.group_id], seg, *rr.read.heads_of(seg), Staging()).clone())
                moved += sink.nbytes
    return moved


@pytest.mark.parametrize(("p_tp", "d_tp", "p_layout", "d_layout"), [(2, 1, SD, SD), (1, 2, SD, DS), (2, 4, DS, SD), (4, 2, DS, DS)])
@pytest.mark.parametrize("family", ["mamba2", "mamba2_one_group", "gated_delta_net"])
def test_state_moves_exactly_across_tp_and_conv_layouts(family, p_tp, d_tp, p_layout, d_layout):
    """``mamba2_one_group``: Granite 4.0-H's and Falcon-H1's ``n_groups=1``,
    whose B and C every rank of a wider TP holds a replica of."""
    def shape(layout):
        if family.startswith("mamba2"):
            groups = 1 if family == "mamba2_one_group" else 4
            return mamba2(num_heads=8, head_dim=4, n_groups=groups, d_state=8, conv_kernel=4, dtype="bfloat16", ssm_dtype="float32", conv_layout=layout)
        return gated_delta_net(k_heads=4, v_heads=8, k_dim=8, v_dim=4, conv_kernel=4, dtype="bfloat16", ssm_dtype="float32", conv_layout=layout)

    p_meta, p_ranks = _engine("p", shape(p_layout), p_tp)
    d_meta, d_ranks = _engine("d", shape(d_layout), d_tp)
    for tp, (_b, groups, tensors) in enumerate(p_ranks):
        for t, c in zip(tensors, _coords(groups, tp, p_tp), strict=True):
            pattern.fill(t, 7, [3], c)  # the running state
            pattern.fill(t, 99, [0], c)  # another request's
    def wrong(tp):
        _b, groups, tensors = d_ranks[tp]
        return [pattern.mismatch(t, 7, [5], c, g.spec.block_size) for g, t, c in zip(groups, tensors, _coords(groups, tp, d_tp), strict=True)]

    assert all(m is not None for tp in range(d_tp) for m in wrong(tp))  # negative control: not there before
    moved = _move(p_meta, p_ranks, d_meta, d_ranks, 3, 5)
    assert [m for tp in range(d_tp) for m in wrong(tp)] == [None] * (d_tp * len(d_ranks[0][1]))
    # Exactly the state: every part of every layer once, no padding, no other
    # block; a replicated part (B and C of one group) once per decode rank
    # holding a replica: each reads its own (a few hundred bytes a layer).
    replicated = sum(p.width * 3 * 2 for p in shape(SD).conv if p.total_heads < d_tp) * (d_tp - 1)
    assert moved == (shape(SD).page_bytes(1) + replicated) * len(LAYERS)
    for _buf, _groups, tensors in d_ranks:
        others = torch.ones(NUM_BLOCKS, dtype=torch.bool)
        others[5] = False
        for t in tensors:
            for _i, _c, view in t.layer_runs(0, tuple(range(len(LAYERS)))):
                assert not view[:, :, others].any()
    # A flipped element anywhere in one part is caught: the check can fail.
    _b, groups, tensors = d_ranks[0]
    for _i, _c, view in tensors[1].layer_runs(0, (1,)):
        view[0, 0, 5, -1, -1, -1] += 1
    assert pattern.mismatch(tensors[1], 7, [5], _coords(groups, 0, d_tp)[1], groups[1].spec.block_size) is not None


def test_a_state_shape_that_tp_cannot_split_or_replicate_is_refused_by_name():
    with pytest.raises(InvalidArgument) as e:
        mamba2(num_heads=12, head_dim=4, n_groups=3, d_state=8, conv_kernel=4, dtype="bfloat16").specs(2, NUM_BLOCKS)
    assert e.value.field == "state.conv.B.heads"
    # One group at TP2 is replicated (vLLM's extra_groups_for_head_shards): each rank holds it whole.
    b = mamba2(num_heads=8, head_dim=4, n_groups=1, d_state=8, conv_kernel=4, dtype="bfloat16").specs(2, NUM_BLOCKS)[1]
    assert (b.num_kv_heads, b.total_heads) == (1, 1)


@pytest.mark.parametrize(("change", "message"), [
    ({"d_state": 16}, "group[1].head_size: local=16 remote=8"),  # B's width
    ({"conv_kernel": 3}, "group[0].block_size: local=2 remote=3"),  # the conv state's rows
    ({"ssm_dtype": "bfloat16"}, "group[3].dtype: local='bfloat16' remote='float32'"),
])
def test_state_shapes_that_differ_are_refused_naming_group_and_both_values(change, message):
    base = {"num_heads": 8, "head_dim": 4, "n_groups": 4, "d_state": 8, "conv_kernel": 4, "dtype": "bfloat16", "ssm_dtype": "float32"}
    p_meta, _ = _engine("p", mamba2(**base), 2)
    d_meta, _ = _engine("d", mamba2(**{**base, **change}), 1)
    with pytest.raises(Incompatible) as e:
        check_compatible(d_meta, p_meta)
    assert message in str(e.value)


def test_state_heads_over_tp_must_match():
    base = {"head_dim": 4, "n_groups": 4, "d_state": 8, "conv_kernel": 4, "dtype": "bfloat16"}
    p_meta, _ = _engine("p", mamba2(num_heads=8, **base), 2)
    d_meta, _ = _engine("d", mamba2(num_heads=16, **{**base, "head_dim": 2}), 1)
    with pytest.raises(Incompatible, match=r"group\[0\].(total_heads|head_size)"):
        check_compatible(d_meta, p_meta)


def test_a_state_spec_is_one_plane_and_needs_a_state_kind():
    spec = mamba2(num_heads=8, head_dim=4, n_groups=4, d_state=8, conv_kernel=4, dtype="bfloat16").specs(1, NUM_BLOCKS)[0]
    assert spec.num_kv == 1 and spec.parts_per_layer == 1
    with pytest.raises(InvalidArgument, match="kind"):
        GroupSpec(0, spec, ())
    with pytest.raises(InvalidArgument, match=r"spec\.layout"):
        dataclasses.replace(spec, layout=("kv", "block", "token", "head", "dim"))


def test_a_daemon_takes_a_model_of_state_only_and_refuses_attention_without_heads(daemons):
    from kvd.caches import allocate_kv_caches, allocate_state_pages
    from kvd.client import KvdClient, daemon_status
    from kvd.core.groups import STATE_PART
    from kvd.core.spec import KVCacheSpec, ModelInfo, WorkerId, parse_layout

    p = daemons.start("prefill")
    shape = mamba2(num_heads=8, head_dim=4, n_groups=4, d_state=8, conv_kernel=4, dtype="bfloat16", ssm_dtype="float32")
    pages = allocate_state_pages(["model.layers.0.mixer", "model.layers.1.mixer"], NUM_BLOCKS, shape.page_bytes(2) + 32)
    parts = shape.layer_parts(pages, 2)
    client = KvdClient(p.grpc, WorkerId("prefill", 1, 2))
    client.wait_ready()
    # A pure Mamba2: no KV heads at all, four state groups over one page per layer.
    resp = client.register(parts, ModelInfo(2, 0), kinds=[STATE_PART] * len(parts))
    assert resp.registered_bytes > 0
    assert [w.layers for w in daemon_status(p.grpc).workers] == [2 * len(parts)]
    # An attention group in a model that says it has no KV heads is refused by name.
    attn = KVCacheSpec(16, 1, 16, "bfloat16", parse_layout("NHD"), NUM_BLOCKS)
    other = KvdClient(p.grpc, WorkerId("prefill", 0, 2))
    with pytest.raises(InvalidArgument, match=r"model.total_num_kv_heads=0 must be positive: groups\[0\] is a full group"):
        other.register([(attn, allocate_kv_caches(attn, ["model.layers.0.self_attn.attn"]))], ModelInfo(2, 0))
    # A rank of the same engine whose state part splits differently is refused by name.
    wrong = mamba2(num_heads=16, head_dim=2, n_groups=4, d_state=8, conv_kernel=4, dtype="bfloat16", ssm_dtype="float32")
    pages = allocate_state_pages(["model.layers.0.mixer", "model.layers.1.mixer"], NUM_BLOCKS, wrong.page_bytes(2))
    parts = wrong.layer_parts(pages, 2)
    with pytest.raises(InvalidArgument, match=r"groups\[0\].spec.num_kv_heads=8 differs from another rank's 4"):
        other.register(parts, ModelInfo(2, 0), kinds=[STATE_PART] * len(parts))


def test_a_state_prefill_did_not_offer_is_refused_not_left_as_it_was():
    shape = mamba2(num_heads=8, head_dim=4, n_groups=4, d_state=8, conv_kernel=4, dtype="bfloat16")
    p_meta, _ = _engine("p", shape, 1)
    d_meta, d_ranks = _engine("d", shape, 1)
    _buf, groups, tensors = d_ranks[0]
    offer = Offer("req", 1, b"", ((3,), (), (3,), (3,)), 100)
    with pytest.raises(Incompatible, match=r"group\[1\].block_ids"):
        plan_pull(local_meta=d_meta, local_tp_rank=0, local_pp_rank=0, local_groups=tensors, local_group_specs=groups,
                  remote=p_meta, params=offer, local_block_ids=[[5]] * 4)


@settings(max_examples=40, deadline=None)
@given(p_tp=st.sampled_from([1, 2, 4]), d_tp=st.sampled_from([1, 2, 4]), p_layout=st.sampled_from([SD, DS]), d_layout=st.sampled_from([SD, DS]),
       groups=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([2, 4, 8]), spare=st.integers(1, NUM_BLOCKS - 1), data=st.data())
def test_any_state_pairing_lands_each_rank_its_own_heads_exactly(p_tp, d_tp, p_layout, d_layout, groups, head_dim, spare, data):
    """Any TP pair, conv layouts and shape: each decode rank's parts hold
    exactly its heads of prefill's state, in its own block, and nothing else."""
    def shape(layout):
        return mamba2(num_heads=8, head_dim=head_dim, n_groups=groups, d_state=4, conv_kernel=3, dtype="float16", ssm_dtype="float32",
                      conv_layout=layout)

    p_block = data.draw(st.integers(1, NUM_BLOCKS - 1))
    p_meta, p_ranks = _engine("p", shape(p_layout), p_tp)
    d_meta, d_ranks = _engine("d", shape(d_layout), d_tp)
    for tp, (_b, gs, tensors) in enumerate(p_ranks):
        for t, c in zip(tensors, _coords(gs, tp, p_tp), strict=True):
            pattern.fill(t, 11, [p_block], c)
    _move(p_meta, p_ranks, d_meta, d_ranks, p_block, spare)
    for tp, (_b, gs, tensors) in enumerate(d_ranks):
        for g, t, c in zip(gs, tensors, _coords(gs, tp, d_tp), strict=True):
            assert pattern.mismatch(t, 11, [spare], c, g.spec.block_size) is None
            others = torch.ones(NUM_BLOCKS, dtype=torch.bool)
            others[spare] = False
            for _i, _c, view in t.layer_runs(0, tuple(range(len(LAYERS)))):
                assert not view[:, :, others].any()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 4)])
def test_verification_digests_of_moved_state_agree_and_a_missing_part_is_caught(p_tp, d_tp):
    """Verification (core/digest.py) on state parts: P's digest of its
    running state equals D's of what landed, across TP, conv layouts and
    Granite-style replicated B and C; a part that never landed (D's conv
    state zeroed, as where a part goes missing) differs, in that part only."""
    from kvd.core.digest import DigestQuery, DigestRows, RowDigests, RowSample, answer, compare

    def shape(layout):
        return mamba2(num_heads=8, head_dim=4, n_groups=1, d_state=8, conv_kernel=4, dtype="bfloat16", ssm_dtype="float32", conv_layout=layout)

    p_meta, p_ranks = _engine("p", shape(SD), p_tp)
    d_meta, d_ranks = _engine("d", shape(DS), d_tp)
    for tp, (_b, groups, tensors) in enumerate(p_ranks):
        for t, c in zip(tensors, _coords(groups, tp, p_tp), strict=True):
            pattern.fill(t, 7, [3], c)
    _move(p_meta, p_ranks, d_meta, d_ranks, 3, 5)
    sample = RowSample(5)

    def differ(tp: int) -> list[int]:
        """The groups where D rank ``tp`` differs from P's answer."""
        _b, groups, tensors = d_ranks[tp]
        bad = []
        for gi, (g, t, c) in enumerate(zip(groups, tensors, _coords(groups, tp, d_tp), strict=True)):
            bs = g.spec.block_size
            mine = RowDigests.of(t, g.group_id, [5], 0, bs, c.head_start, sample)
            heads = range(c.head_start, c.head_start + g.spec.num_kv_heads)
            query = DigestQuery("p", "req", 1, b"", (DigestRows(g.group_id, LAYERS, heads, 0, bs, bs),))
            held = [[RowDigests.of(pt[gi], pg[gi].group_id, [3], 0, bs, pc[gi].head_start, sample) if i == gi else None
                     for i in range(len(pg))] for r, (_pb, pg, pt) in enumerate(p_ranks) for pc in [_coords(pg, r, p_tp)]]
            theirs = answer(query, sample, held).sums[0]
            if compare(LAYERS, mine.bins(LAYERS, heads, 0, bs, bs), theirs) is not None:
                bad.append(g.group_id)
        return bad

    assert all(differ(tp) == [] for tp in range(d_tp))
    _b, groups, tensors = d_ranks[0]
    for _i, _c, view in tensors[0].layer_runs(0, (0, 1)):
        view[:, :, 5] = 0  # the first conv part never landed
    assert differ(0) == [groups[0].group_id]
