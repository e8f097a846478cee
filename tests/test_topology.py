import dataclasses

import pytest

from kvd.core.errors import Incompatible
from kvd.core.topology import EngineShape, heads_of_rank, read_targets


def shape(tp, heads=8, pp=1, layers=4, mla=False):
    per = -(-layers // pp)
    return EngineShape(tp, pp, heads, mla, {s: frozenset(range(s * per, min(layers, (s + 1) * per))) for s in range(pp)})


def test_decode_wider_reads_head_slice_of_one_rank():
    t = read_targets(shape(8), shape(2), local_tp_rank=5, local_pp_rank=0)
    assert [(x.remote_tp_rank, x.remote_head_start, x.head_count, x.local_head_start) for x in t] == [(1, 1, 1, 0)]


def test_decode_narrower_gathers_from_several_ranks():
    t = read_targets(shape(2), shape(8), local_tp_rank=1, local_pp_rank=0)
    assert [(x.remote_tp_rank, x.local_head_start) for x in t] == [(4, 0), (5, 1), (6, 2), (7, 3)]


def test_replicated_remote_heads_spread_over_replicas():
    # 2 heads, P TP8: each head on 4 ranks; D TP4 also replicated (2 per head).
    picks = [read_targets(shape(4, heads=2), shape(8, heads=2), r, 0)[0].remote_tp_rank for r in range(4)]
    assert picks == [0, 1, 6, 7]  # head h lives on ranks 4h..4h+3; replica = local rank % 4
    assert len(set(picks)) == 4


def test_mla_reads_one_rank():
    t = read_targets(shape(4, heads=1, mla=True), shape(2, heads=1, mla=True), 3, 0)
    assert len(t) == 1 and t[0].remote_tp_rank == 1


def test_pp_reads_exactly_owned_layers_from_each_stage():
    t = read_targets(shape(1, pp=2, layers=8), shape(1, pp=4, layers=8), 0, 1)
    assert [(x.remote_pp_rank, x.layers) for x in t] == [(2, (4, 5)), (3, (6, 7))]


def test_every_local_rank_covers_its_heads_exactly_once():
    for tp_l in (1, 2, 4, 8):
        for tp_r in (1, 2, 4, 8):
            for heads in (1, 2, 4, 8):
                for r in range(tp_l):
                    mine = heads_of_rank(r, tp_l, heads, False)
                    got = sorted((x.local_head_start, x.head_count) for x in read_targets(shape(tp_l, heads), shape(tp_r, heads), r, 0))
                    covered = [h for s, c in got for h in range(s, s + c)]
                    assert covered == list(range(mine.count))


@pytest.mark.parametrize("tp, heads", [(3, 8), (6, 4)])
def test_non_divisible_tp_is_refused(tp, heads):
    with pytest.raises(Incompatible, match="tp_size"):
        read_targets(shape(tp, heads), shape(2, heads), 0, 0)


def test_head_count_mismatch_names_both():
    with pytest.raises(Incompatible, match=r"total_num_kv_heads: local=8 remote=4"):
        read_targets(shape(2, 8), shape(2, 4), 0, 0)


def hybrid(tp, heads=1, state_heads=8, layers=4, pp=1):
    """Odd layers attention (``heads`` KV heads), even layers one state group of ``state_heads``."""
    from kvd.core.topology import StateSplit

    base = shape(tp, heads, pp, layers)
    return EngineShape(tp, pp, heads, False, base.layers_by_pp_rank, {1: StateSplit(state_heads, frozenset(range(0, layers, 2)))})


def test_state_parts_split_by_their_own_heads_where_attention_replicates():
    # One KV head over P's TP2 is replicated, so attention reads one P rank;
    # the state's 8 heads are split, so D TP1 reads half of them from each.
    t = read_targets(hybrid(1), hybrid(2), 0, 0)
    got = [(x.groups, x.remote_tp_rank, x.remote_head_start, x.head_count, x.local_head_start, x.layers) for x in t]
    assert got == [(None, 0, 0, 1, 0, (1, 3)), ((1,), 0, 0, 4, 0, (0, 2)), ((1,), 1, 0, 4, 4, (0, 2))]


def test_state_parts_turn_replica_fanout_off():
    from kvd.core.topology import fanout_source

    # Attention alone: D rank 1 holds rank 0's very heads and copies from it.
    assert fanout_source(shape(2, heads=1), 1, 0, frozenset({(0, 0), (1, 0)})) == 0
    # With a state group its state differs from rank 0's: it reads its own.
    assert fanout_source(hybrid(2), 1, 0, frozenset({(0, 0), (1, 0)})) is None
    t = read_targets(hybrid(2), hybrid(1), 1, 0, frozenset({(0, 0), (1, 0)}))
    assert [(x.groups, x.remote_head_start, x.head_count) for x in t] == [(None, 0, 1), ((1,), 4, 4)]


def test_state_heads_that_differ_are_refused_by_group():
    with pytest.raises(Incompatible, match=r"group\[1\].total_heads: local=8 remote=16"):
        read_targets(hybrid(2), hybrid(2, state_heads=16), 0, 0)


def test_a_pure_state_model_has_no_attention_targets():
    from kvd.core.topology import StateSplit

    pure = EngineShape(2, 1, 0, False, {0: frozenset(range(4))}, {0: StateSplit(4, frozenset(range(4)))})
    t = read_targets(dataclasses.replace(pure, tp_size=1), pure, 0, 0)
    assert [(x.groups, x.remote_tp_rank, x.head_count, x.local_head_start) for x in t] == [((0,), 0, 2, 0), ((0,), 1, 2, 2)]


def _group(layout="NHD", block_size=16, heads=4, group_id=0):
    from kvd.core.spec import NAMED_LAYOUTS, GroupSpec, KVCacheSpec

    return GroupSpec(group_id, KVCacheSpec(block_size, heads, 64, "bfloat16", NAMED_LAYOUTS[layout], 32), ())


def _meta(*groups):
    from kvd.core.engine_meta import EngineLayout, EngineMeta
    from kvd.core.spec import ModelInfo

    return EngineMeta("p", "epoch", "host", "127.0.0.1:1", 1, 1, ModelInfo(4, 4), (EngineLayout(0, 0, tuple(groups)),))


@pytest.mark.parametrize(("local", "in_order"), [
    (_group(), True),
    (_group(layout="HND"), False),  # a relayout
    (_group(block_size=32), False),  # a block-size change
    (_group(heads=2), False),  # a head slice of the remote rank
    (_group(group_id=1), False),  # no remote counterpart
])
def test_a_read_is_in_wire_order_only_where_nothing_is_relaid_out(local, in_order):
    from kvd.core.pairing import in_wire_order

    assert in_wire_order([local], _meta(_group())) is in_order
    assert not in_wire_order([], _meta(_group()))


def test_a_layer_holding_attention_and_state_reads_both():
    """Falcon-H1 runs attention and Mamba2 side by side in every layer: each
    layer index is in the attention groups and in the state groups, and D
    reads both (before, the attention of a layer that held state was
    skipped, and D decoded on KV it never received)."""
    from kvd.core.topology import StateSplit

    layers = frozenset(range(4))
    parallel = EngineShape(1, 1, 2, False, {0: layers}, {1: StateSplit(24, layers), 2: StateSplit(1, layers)}, attention_layers=layers)
    targets = read_targets(parallel, parallel, 0, 0)
    attention = [t for t in targets if t.groups is None]
    assert len(attention) == 1 and attention[0].layers == (0, 1, 2, 3)
    assert sorted(t.groups for t in targets if t.groups is not None) == [(1,), (2,)]
    # Without saying which layers attend (the old shape), a layer holding state is taken for state only.
    serial = EngineShape(1, 1, 2, False, {0: layers}, {1: StateSplit(24, frozenset({0, 2}))})
    assert [t.layers for t in read_targets(serial, serial, 0, 0) if t.groups is None] == [(1, 3)]
