"""Property-based tests of the planning and relayout core: shard a logical KV
tensor onto P ranks in P's layout, run the planned transfer into D ranks in
D's layout, and check exact reconstruction."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.core.errors import Incompatible, InvalidArgument
from kvd.core.groups import CHUNKED_LOCAL, SLIDING_WINDOW, GroupKind
from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
from kvd.core.topology import heads_of_rank
from kvd.testing import pattern
from kvd.testing.sim import make_engine, transfer

JOINED_OR_SPLIT = ["NHD", "HND", "NHD_BLOCKS_FIRST", "HND_BLOCKS_FIRST", "NHD_SPLIT", "HND_SPLIT"]
DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn"]


@st.composite
def pairings(draw):
    mla = draw(st.booleans())
    opaque = not mla and draw(st.integers(0, 5)) == 0
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    tp_p, tp_d = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    pp_p, pp_d = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    bs_p = draw(st.sampled_from([1, 16, 32, 64, 128]))
    bs_d = bs_p if opaque else draw(st.sampled_from([1, 16, 32, 64, 128]))
    if mla:
        lay_p = lay_d = "MLA"
    elif opaque:
        lay_p = lay_d = "OPAQUE"
    else:
        lay_p, lay_d = draw(st.sampled_from(JOINED_OR_SPLIT)), draw(st.sampled_from(JOINED_OR_SPLIT))
    dtype = draw(st.sampled_from(DTYPES))
    head_size = draw(st.sampled_from([2, 4]))
    num_tokens = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 1 << 16))
    return dict(mla=mla, heads=heads, tp_p=tp_p, tp_d=tp_d, pp_p=pp_p, pp_d=pp_d, bs_p=bs_p, bs_d=bs_d, lay_p=lay_p,
                lay_d=lay_d, dtype=dtype, head_size=head_size, num_tokens=num_tokens, seed=seed, stacked=draw(st.booleans()),
                # memory in another order than the wire's (as vLLM's CPU attention stores K), on either side
                mem_p=draw(st.integers(0, 3)) == 0, mem_d=draw(st.integers(0, 3)) == 0)


def spec_for(c, tp, bs, layout, num_blocks):
    def make(tp_rank):
        h = heads_of_rank(tp_rank, tp, c["heads"], c["mla"]).count
        opaque = layout == "OPAQUE"
        return KVCacheSpec(block_size=bs, num_kv_heads=h, head_size=c["head_size"], dtype=c["dtype"], layout=NAMED_LAYOUTS[layout],
                           num_blocks=num_blocks, use_mla=c["mla"], span_size=2 * bs * c["head_size"] if opaque else 0)
    return make


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairings())
def test_any_pairing_reconstructs_exactly(c):
    rng = random.Random(c["seed"])
    model = ModelInfo(num_layers=4, total_num_kv_heads=c["heads"])
    n_p, n_d = -(-c["num_tokens"] // c["bs_p"]), -(-c["num_tokens"] // c["bs_d"])
    nb_p, nb_d = n_p + 3, n_d + 3
    p = make_engine("P", c["tp_p"], c["pp_p"], model, spec_for(c, c["tp_p"], c["bs_p"], c["lay_p"], nb_p), rng, stacked=c["stacked"], use_mla=c["mla"],
                    shuffle_memory=c["mem_p"])
    d = make_engine("D", c["tp_d"], c["pp_d"], model, spec_for(c, c["tp_d"], c["bs_d"], c["lay_d"], nb_d), rng, stacked=True, use_mla=c["mla"],
                    shuffle_memory=c["mem_d"])
    # Block ids: some runs, some scattered.
    p_ids = rng.sample(range(nb_p), n_p) if rng.random() < 0.5 else list(range(1, n_p + 1))
    d_ids = rng.sample(range(nb_d), n_d) if rng.random() < 0.5 else list(range(2, n_d + 2))
    for r in p.ranks.values():
        pattern.fill(r.tensors, c["seed"], p_ids, r.coords)
    read = transfer(p, d, "req", p_ids, d_ids, c["num_tokens"], segment_bytes=rng.choice([256, 4096, 1 << 20]),
                    zero_copy_min_bytes=rng.choice([1, 512, 1 << 30]))
    for (tp, pp), r in d.ranks.items():
        bad = pattern.mismatch(r.tensors, c["seed"], d_ids, r.coords, c["num_tokens"])
        assert bad is None, f"D tp{tp}/pp{pp}: {bad}"
    # No P byte is read twice by the D engine unless D replicates it.
    d_replication = max(1, c["tp_d"] // c["heads"]) if not c["mla"] else c["tp_d"]
    p_bytes_needed = sum(r.tensors.spec.bytes_per_block_per_layer * len(r.group.layers) * len(p_ids) for r in p.ranks.values())
    p_replication = max(1, c["tp_p"] // c["heads"]) if not c["mla"] else c["tp_p"]
    unique_needed = p_bytes_needed // p_replication
    assert sum(read.values()) <= unique_needed * d_replication


def vllm_kept_from(kind: GroupKind, num_computed: int, block_size: int) -> int:
    """The first token of a window group's blocks vLLM keeps once
    ``num_computed`` tokens are computed (its get_num_skipped_tokens), as an
    independent reference: P keeps this of a prompt's N tokens, and D, which
    kvd's connector has load N - 1, of N - 1."""
    if kind.name == SLIDING_WINDOW:
        skipped = max(0, num_computed - kind.window + 1)
    else:
        skipped = num_computed // kind.window * kind.window
    return skipped // block_size * block_size


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairings(), st.sampled_from([SLIDING_WINDOW, CHUNKED_LOCAL]), st.integers(1, 200), st.booleans())
def test_a_window_group_moves_exactly_what_decode_needs_on_any_pairing(c, kind_name, window, d_offers_more):
    """A prompt of N tokens: P computed all of them and keeps its blocks as
    vLLM does (null blocks before); D loads N - 1 and computes position N - 1,
    offering its own blocks (or one more). Either every token position N - 1
    attends to lands exactly and nothing before D's offer is written, or the
    pull is refused by name."""
    if c["mla"] or c["lay_p"] == "OPAQUE":
        c = {**c, "mla": False, "heads": 2, "lay_p": "NHD", "lay_d": "HND", "bs_d": c["bs_d"] if c["bs_d"] > 1 else 16}
    kind = GroupKind(kind_name, window)
    rng = random.Random(c["seed"])
    model = ModelInfo(num_layers=4, total_num_kv_heads=c["heads"])
    prompt = c["num_tokens"] + 1
    n = prompt - 1  # loaded
    # What position n attends to, from attention's own definition.
    needed = max(0, n - window + 1) if kind_name == SLIDING_WINDOW else n // window * window
    p_first = vllm_kept_from(kind, prompt, c["bs_p"])
    d_first = max(0, vllm_kept_from(kind, n, c["bs_d"]) - (c["bs_d"] if d_offers_more else 0))
    if p_first >= prompt or needed >= n:
        return  # P kept no block of the group, or decode needs none of its tokens
    n_p, n_d = -(-(prompt - p_first) // c["bs_p"]), -(-(n - d_first) // c["bs_d"])
    p = make_engine("P", c["tp_p"], c["pp_p"], model, spec_for(c, c["tp_p"], c["bs_p"], c["lay_p"], n_p + 3), rng, kind=kind)
    d = make_engine("D", c["tp_d"], c["pp_d"], model, spec_for(c, c["tp_d"], c["bs_d"], c["lay_d"], n_d + 3), rng, kind=kind)
    p_ids, d_ids = rng.sample(range(n_p + 3), n_p), rng.sample(range(n_d + 3), n_d)
    for r in p.ranks.values():
        pattern.fill(r.tensors, c["seed"], p_ids, r.coords, first_token=p_first)
    try:
        transfer(p, d, "req", p_ids, d_ids, n, p_first=p_first, d_first=d_first, segment_bytes=rng.choice([256, 4096, 1 << 20]))
    except (Incompatible, InvalidArgument) as e:
        # Refused only for a reason it names: P lacks a needed token, D's first
        # window block would be part filled, or D offered blocks it would not fill.
        if p_first > needed:
            assert "group[0].first_token" in e.field, e
        else:
            assert e.field in ("group[0].block_size", "local_block_ids[0].first_token"), e
            assert d_offers_more or c["bs_d"] > c["bs_p"], e
        return
    assert p_first <= needed, "prefill lacked a token decode needs, and the pull went on"
    for (tp, pp), r in d.ranks.items():
        bad = pattern.mismatch(r.tensors, c["seed"], d_ids, r.coords, n, first_token=d_first, valid_from=needed)
        assert bad is None, f"D tp{tp}/pp{pp}: {bad}"


def _two(mla=False, heads=4, bs_p=16, bs_d=16, lay_p="NHD", lay_d="NHD", dtype_p="bfloat16", dtype_d="bfloat16", hs_p=8, hs_d=8,
         sf_p="", sf_d=""):
    rng = random.Random(0)
    model = ModelInfo(2, heads)

    def mk(tp, bs, lay, dt, hs, sf):
        return lambda r: KVCacheSpec(bs, heads_of_rank(r, tp, heads, mla).count, hs, dt, NAMED_LAYOUTS[lay], 8, mla,
                                     2 * bs * hs if lay == "OPAQUE" else 0, sf)
    p = make_engine("P", 1, 1, model, mk(1, bs_p, lay_p, dtype_p, hs_p, sf_p), rng)
    d = make_engine("D", 1, 1, model, mk(1, bs_d, lay_d, dtype_d, hs_d, sf_d), rng)
    return p, d


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dtype_d="float16"), "dtype"),
        (dict(hs_d=16), "head_size"),
        (dict(lay_p="OPAQUE", lay_d="OPAQUE", bs_d=32), "block_size"),
        (dict(lay_d="OPAQUE"), "layout"),
        # spans written by two kernels (vLLM's AMX tiles, NEON's BFMMLA tiles): same size, other places
        (dict(lay_p="OPAQUE", lay_d="OPAQUE", sf_p="vllm-cpu-amx-bfloat16", sf_d="vllm-cpu-neon-bfloat16"), "span_format"),
        (dict(bs_p=16, bs_d=24), "block_size"),
    ],
)
def test_impossible_pairings_are_refused_naming_both_values(kwargs, field):
    p, d = _two(**kwargs)
    with pytest.raises(Incompatible) as e:
        transfer(p, d, "r", [1, 2], [1, 2], 16)
    assert field in e.value.message
    assert "local=" in e.value.message and "remote=" in e.value.message
