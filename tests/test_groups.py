"""KV-cache groups that attend differently: full attention beside a sliding
window or chunked local attention, overlaid on one buffer as vLLM's hybrid
allocator does. Each group moves only the tokens decode needs of it."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.caches import allocate_kv_caches, describe, local_group_tensors
from kvd.client import KvdClient
from kvd.core.errors import InvalidArgument, KvdError, Status
from kvd.core.groups import CHUNKED_LOCAL, FULL, SLIDING_WINDOW, GroupKind
from kvd.core.plan import plan_extents
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from kvd.spec import KVCacheSpec, ModelInfo, WorkerId, parse_layout
from kvd.testing import pattern
from tests.conftest import scrape

# ---------------------------------------------------------------- what decode needs


def test_what_decode_needs_of_each_kind():
    # N tokens loaded, decode computes position N next.
    assert GroupKind().first_needed_token(1000) == 0
    # Position N attends to the W positions ending at itself.
    assert GroupKind(SLIDING_WINDOW, 64).first_needed_token(1000) == 937
    assert GroupKind(SLIDING_WINDOW, 64).first_needed_token(50) == 0
    assert GroupKind(SLIDING_WINDOW, 64).first_needed_block_token(1000, 16) == 928
    # Chunked local: the chunk holding position N, from its start; none when N starts one.
    assert GroupKind(CHUNKED_LOCAL, 256).first_needed_token(1000) == 768
    assert GroupKind(CHUNKED_LOCAL, 256).first_needed_token(1023) == 768
    assert GroupKind(CHUNKED_LOCAL, 256).first_needed_token(1024) == 1024


@pytest.mark.parametrize(("name", "window", "field"), [
    ("sliding", 64, "group.kind"), (FULL, 64, "group.window_tokens"), (SLIDING_WINDOW, 0, "group.window_tokens"),
])
def test_a_malformed_kind_is_refused_by_name(name, window, field):
    with pytest.raises(InvalidArgument) as e:
        GroupKind(name, window)
    assert e.value.field == field


# ---------------------------------------------------------------- planning from a first token


@settings(max_examples=300, deadline=None)
@given(
    rbs=st.sampled_from([8, 16, 32, 64]), lbs=st.sampled_from([8, 16, 32, 64]),
    n=st.integers(1, 700), data=st.data(),
)
def test_extents_move_exactly_the_tokens_from_start_each_to_its_own_place(rbs, lbs, n, data):
    small = min(rbs, lbs)
    start = data.draw(st.integers(0, (n - 1) // lbs)) * lbs  # a local block boundary
    remote_first = data.draw(st.integers(0, start // rbs)) * rbs
    local_first = data.draw(st.integers(0, start // lbs)) * lbs
    r_ids = data.draw(st.permutations(range(100, 100 + -(-(n - remote_first) // rbs))))
    l_ids = data.draw(st.permutations(range(500, 500 + -(-(n - local_first) // lbs))))
    ext = plan_extents(r_ids, rbs, l_ids, lbs, n, remote_first=remote_first, local_first=local_first, start=start, max_units=3)

    def tokens(remote: bool) -> list[int]:
        ids, bs, first = (r_ids, rbs, remote_first) if remote else (l_ids, lbs, local_first)
        out = []
        for i in range(len(ext)):
            block, count, t0, tc = ext.side(i, remote)
            for b in range(block, block + count):
                assert b in ids, f"block {b} is not the request's"
                out += [first + ids.index(b) * bs + t for t in range(t0, t0 + tc)]
        return out

    r, loc = tokens(True), tokens(False)
    assert r == loc  # each token lands where the other side holds it
    end = start + -(-(n - start) // small) * small
    assert r == list(range(start, end))  # every token from start, once, and none before


def test_a_side_that_starts_after_what_is_needed_is_refused():
    with pytest.raises(InvalidArgument, match=r"remote block_ids.first_token"):
        plan_extents([1, 2], 16, [1, 2, 3, 4], 16, 64, remote_first=32, start=16)
    with pytest.raises(InvalidArgument, match=r"local block_ids.first_token"):
        plan_extents([1, 2], 16, [1, 2], 32, 64, local_first=8, start=32)


# ---------------------------------------------------------------- daemons

LAYERS, HEADS, N, WINDOW = 4, 4, 300, 64


def _hybrid_worker(address: str, engine: str, block_size: int, kind: GroupKind, num_blocks: int = 64):
    """Layers 0, 2 full attention and 1, 3 of ``kind``, overlaid on one
    buffer (layer 1 on layer 0's bytes, 3 on 2's), as vLLM's hybrid allocator
    lays them out; the groups' block ids never overlap."""
    spec = KVCacheSpec(block_size, HEADS, 16, "bfloat16", parse_layout("NHD"), num_blocks)
    full = allocate_kv_caches(spec, ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"])
    other = {"model.layers.1.self_attn.attn": full["model.layers.0.self_attn.attn"],
             "model.layers.3.self_attn.attn": full["model.layers.2.self_attn.attn"]}
    client = KvdClient(address, WorkerId(engine))
    client.wait_ready()
    client.register([(spec, full), (spec, other)], ModelInfo(LAYERS, HEADS), kinds=[GroupKind(), kind])
    return client, local_group_tensors(spec, full), local_group_tensors(spec, other)


def _blocks(first: int, bs: int, start: int) -> list[int]:
    return list(range(start, start + -(-(N - first) // bs)))


@pytest.mark.parametrize(("kind", "d_block"), [
    (GroupKind(SLIDING_WINDOW, WINDOW), 16), (GroupKind(SLIDING_WINDOW, WINDOW), 32), (GroupKind(CHUNKED_LOCAL, 128), 32),
], ids=["window-b16", "window-b32", "chunk128-b32"])
def test_a_window_group_moves_only_what_decode_needs(daemons, kind, d_block):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pc, p_full, p_win = _hybrid_worker(p.grpc, "prefill", 16, kind)
    dc, d_full, d_win = _hybrid_worker(d.grpc, "decode", d_block, kind)
    start = kind.first_needed_block_token(N, d_block)  # 224 for the window, 256 for the chunk
    # Each side holds every token of the full group, and of the other what
    # decode needs of it, from its own block holding the first such token
    # (vLLM's null blocks before it dropped).
    p_ids_full, p_first = _blocks(0, 16, 1), kind.first_needed_block_token(N, 16)
    p_ids_win = _blocks(p_first, 16, 30)
    pattern.fill(p_full, 5, p_ids_full, pattern.RankCoords(0))
    pattern.fill(p_win, 5, p_ids_win, pattern.RankCoords(0), first_token=p_first)
    params = pc.publish("r", [p_ids_full, p_ids_win], N, first_tokens=[0, p_first])
    # Decode offering blocks before the window is refused by name, and nothing is written.
    d_ids_full, d_ids_all = _blocks(0, d_block, 1), _blocks(0, d_block, 30)
    dc.pull("r", params, [d_ids_full, d_ids_all])
    f = dc.wait_finished(recving={"r"}, timeout=60)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed" and "local_block_ids[1].first_token=0" in detail.reason, detail
    assert pattern.mismatch(d_full, 5, d_ids_full, pattern.RankCoords(0), N) is not None
    assert scrape(d.metrics_url, "kvd_received_bytes_total") == 0
    # From the window on, it moves exactly that.
    d_ids_win = _blocks(start, d_block, 30)
    params = pc.publish("r2", [p_ids_full, p_ids_win], N, first_tokens=[0, p_first])
    dc.pull("r2", params, [d_ids_full, d_ids_win], first_tokens=[0, start])
    f = dc.wait_finished(recving={"r2"}, timeout=60)
    assert f.details[("recving", "r2")].outcome == "done", f.details
    assert pattern.mismatch(d_full, 5, d_ids_full, pattern.RankCoords(0), N) is None
    assert pattern.mismatch(d_win, 5, d_ids_win, pattern.RankCoords(0), N, first_token=start) is None
    # Negative control: the same blocks read as holding the prompt from token 0 do not match.
    assert pattern.mismatch(d_win, 5, d_ids_win, pattern.RankCoords(0), N) is not None
    per_token = 2 * HEADS * 16 * 2  # K and V, heads, head size, bf16
    full_bytes, win_bytes = N * per_token * 2, (N - start) * per_token * 2
    moved = scrape(d.metrics_url, "kvd_received_bytes_total")
    assert full_bytes + win_bytes <= moved < full_bytes + win_bytes + 2 * d_block * per_token * 2  # the last block's tail rides along
    assert scrape(d.metrics_url, "kvd_window_skipped_bytes_total", kind=kind.name) == start * per_token * 2


def test_decode_may_offer_only_the_window_and_prefill_must_hold_it(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    window = GroupKind(SLIDING_WINDOW, WINDOW)
    pc, p_full, p_sw = _hybrid_worker(p.grpc, "prefill", 16, window)
    dc, d_full, d_sw = _hybrid_worker(d.grpc, "decode", 16, window)
    pattern.fill(p_full, 7, _blocks(0, 16, 1), pattern.RankCoords(0))
    pattern.fill(p_sw, 7, _blocks(224, 16, 30), pattern.RankCoords(0), first_token=224)
    params = pc.publish("r", [_blocks(0, 16, 1), _blocks(224, 16, 30)], N, first_tokens=[0, 224])
    dc.pull("r", params, [_blocks(0, 16, 1), _blocks(224, 16, 40)], first_tokens=[0, 224])
    f = dc.wait_finished(recving={"r"}, timeout=60)
    assert f.details[("recving", "r")].outcome == "done", f.details
    assert pattern.mismatch(d_full, 7, _blocks(0, 16, 1), pattern.RankCoords(0), N) is None
    assert pattern.mismatch(d_sw, 7, _blocks(224, 16, 40), pattern.RankCoords(0), N, first_token=224) is None
    # A publication that starts after what decode needs fails the pull, exactly.
    params2 = pc.publish("r2", [_blocks(0, 16, 1), _blocks(256, 16, 30)], N, first_tokens=[0, 256])
    dc.pull("r2", params2, [_blocks(0, 16, 1), _blocks(224, 16, 40)], first_tokens=[0, 224])
    f = dc.wait_finished(recving={"r2"}, timeout=60)
    detail = f.details[("recving", "r2")]
    assert detail.outcome == "failed" and "first_token" in detail.reason, detail
    assert f.invalid_block_ids == set(_blocks(0, 16, 1)) | set(_blocks(224, 16, 40))


def test_a_window_that_would_part_fill_decodes_first_block_is_refused(daemons):
    """P (16-token blocks) kept the window from token 224; D's 64-token block
    from 192 would be left part written, and vLLM caches it by prefix hash."""
    p, d = daemons.start("prefill"), daemons.start("decode")
    window = GroupKind(SLIDING_WINDOW, WINDOW)
    pc, _, _ = _hybrid_worker(p.grpc, "prefill", 16, window)
    dc, _, _ = _hybrid_worker(d.grpc, "decode", 64, window)
    params = pc.publish("r", [_blocks(0, 16, 1), _blocks(224, 16, 30)], N, first_tokens=[0, 224])
    d_ids = [_blocks(0, 64, 1), _blocks(192, 64, 30)]
    dc.pull("r", params, d_ids, first_tokens=[0, 192])
    f = dc.wait_finished(recving={"r"}, timeout=30)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed" and "group[1].block_size" in detail.reason and "part filled" in detail.reason, detail.reason
    assert f.invalid_block_ids == set(d_ids[0]) | set(d_ids[1])


def test_groups_that_attend_differently_are_refused_naming_the_group_and_both_values(daemons):
    p, d = daemons.start("prefill"), daemons.start("decode")
    pc, _, _ = _hybrid_worker(p.grpc, "prefill", 16, GroupKind(SLIDING_WINDOW, WINDOW))
    dc, _, _ = _hybrid_worker(d.grpc, "decode", 16, GroupKind(SLIDING_WINDOW, 128))
    params = pc.publish("r", [_blocks(0, 16, 1), _blocks(224, 16, 30)], N, first_tokens=[0, 224])
    dc.pull("r", params, [_blocks(0, 16, 1), _blocks(0, 16, 30)])
    f = dc.wait_finished(recving={"r"}, timeout=30)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed"
    assert "group[1].window_tokens" in detail.reason and "128" in detail.reason and "64" in detail.reason, detail.reason


def test_a_malformed_group_or_first_token_is_refused_with_its_field(daemons):
    p = daemons.start("prefill")
    spec = KVCacheSpec(16, HEADS, 16, "bfloat16", parse_layout("NHD"), 64)
    caches = allocate_kv_caches(spec, ["model.layers.0.self_attn.attn"])
    client = KvdClient(p.grpc, WorkerId("prefill"))
    client.wait_ready()
    described = describe([(spec, caches)])
    described.groups[0].kind, described.groups[0].window_tokens = "sliding", 64
    request = pb.RegisterRequest(worker=pb.WorkerId(engine_id="prefill", tp_size=1, pp_size=1), model=pb.ModelInfo(num_layers=1, total_num_kv_heads=HEADS),
                                 regions=described.regions, groups=described.groups)
    with grpc.insecure_channel(p.grpc) as ch, pytest.raises(grpc.RpcError) as e:
        pbg.WorkerStub(ch).Register(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "groups[0].kind='sliding'" in e.value.details(), e.value.details()
    client.register([(spec, caches)], ModelInfo(1, HEADS), kinds=[GroupKind(CHUNKED_LOCAL, 256)])
    with pytest.raises(KvdError) as ke:
        client.publish("r", [[1, 2]], 40, first_tokens=[8])
    assert ke.value.status == Status.INVALID_ARGUMENT and "block_ids[0].first_token=8" in ke.value.message
    # The daemon still serves: a good publication goes through.
    assert client.publish("r", [[1, 2]], 40, first_tokens=[16]).block_ids[0].first_token == 16


def test_pattern_sees_a_shifted_window(daemons):
    """The checker is position-aware: the right bytes at the wrong token offset fail."""
    spec = KVCacheSpec(16, HEADS, 16, "bfloat16", parse_layout("NHD"), 8)
    caches = allocate_kv_caches(spec, ["model.layers.0.self_attn.attn"])
    t = local_group_tensors(spec, caches)
    pattern.fill(t, 1, [1, 2], pattern.RankCoords(0), first_token=32)
    assert pattern.mismatch(t, 1, [1, 2], pattern.RankCoords(0), 64, first_token=32) is None
    assert pattern.mismatch(t, 1, [1, 2], pattern.RankCoords(0), 64, first_token=16) is not None
    assert torch.count_nonzero(caches["model.layers.0.self_attn.attn"][:, 0]) == 0


def test_one_block_given_to_two_groups_on_the_same_memory_is_refused_naming_both(daemons):
    """Groups overlaid on one buffer (vLLM's hybrid allocator) never share a
    block id: a Publish or a Pull giving block 22 to both would write one
    group's tokens over the other's. Refused with INVALID_ARGUMENT naming both
    groups and the id; groups that do not share memory may reuse ids."""
    from kvd.errors import InvalidArgument

    window = GroupKind(SLIDING_WINDOW, WINDOW)
    p, d = daemons.start("prefill"), daemons.start("decode")
    pc, p_full, _ = _hybrid_worker(p.grpc, "prefill", 16, window)
    dc, d_full, _ = _hybrid_worker(d.grpc, "decode", 16, window)
    first = window.first_needed_block_token(N, 16)
    with pytest.raises(InvalidArgument, match=r"block_ids\[1\]=22 is also given to group 0, which shares its memory"):
        pc.publish("r", [_blocks(0, 16, 5), _blocks(first, 16, 22)], N, first_tokens=[0, first])  # 5..23 and 22..
    params = pc.publish("r", [_blocks(0, 16, 5), _blocks(first, 16, 30)], N, first_tokens=[0, first])
    d_full_ids = _blocks(0, 16, 5)  # blocks 5..23, so 22 and 23 among them
    with pytest.raises(InvalidArgument, match=r"local_block_ids\[1\]=22 is also given to group 0, which shares its memory"):
        dc.pull("r", params, [d_full_ids, _blocks(first, 16, 22)], first_tokens=[0, first])
    assert scrape(d.metrics_url, "kvd_received_bytes_total") == 0
    # Negative control: disjoint ids are taken.
    pattern.fill(p_full, 5, _blocks(0, 16, 5), pattern.RankCoords(0))
    dc.pull("r", params, [d_full_ids, _blocks(first, 16, 40)], first_tokens=[0, first])
    assert dc.wait_finished(recving={"r"}, timeout=60).details[("recving", "r")].outcome == "done"
    assert pattern.mismatch(d_full, 5, d_full_ids, pattern.RankCoords(0), N) is None


def test_groups_on_separate_memory_may_reuse_block_ids(daemons):
    window = GroupKind(SLIDING_WINDOW, WINDOW)
    p = daemons.start("prefill")
    spec = KVCacheSpec(16, HEADS, 16, "bfloat16", parse_layout("NHD"), 64)
    full = allocate_kv_caches(spec, ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"])
    other = allocate_kv_caches(spec, ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"])  # memory of its own
    client = KvdClient(p.grpc, WorkerId("prefill"))
    client.wait_ready()
    client.register([(spec, full), (spec, other)], ModelInfo(LAYERS, HEADS), kinds=[GroupKind(), window])
    first = window.first_needed_block_token(N, 16)
    assert client.publish("r", [_blocks(0, 16, 1), _blocks(first, 16, 1)], N, first_tokens=[0, first]).generation > 0


def test_one_block_in_two_groups_is_refused_on_vllms_cpu_layout_too(daemons):
    """vLLM's CPU attention cache with the hybrid allocator: one tensor a
    layer index, ``[blocks, heads, tokens, 2*head_size]``, registered as K and
    V strided parts (``CPU_ATTENTION_PARTS``), and the window group's layers on
    the very tensors of the full group's. A block given to both is refused."""
    from kvd.caches import allocate_cpu_attention_caches, cpu_attention_parts
    from kvd.errors import InvalidArgument
    from kvd.spec import CPU_ATTENTION_PARTS, NAMED_LAYOUTS

    window = GroupKind(SLIDING_WINDOW, WINDOW)
    p = daemons.start("prefill")
    spec = KVCacheSpec(16, HEADS, 16, "bfloat16", NAMED_LAYOUTS["CPU"], 64)  # as the connector registers it
    tensors = allocate_cpu_attention_caches(spec, ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"])
    full = {name: cpu_attention_parts(t) for name, t in tensors.items()}
    other = {"model.layers.1.self_attn.attn": full["model.layers.0.self_attn.attn"],
             "model.layers.3.self_attn.attn": full["model.layers.2.self_attn.attn"]}
    client = KvdClient(p.grpc, WorkerId("prefill"))
    client.wait_ready()
    client.register([(spec, full), (spec, other)], ModelInfo(LAYERS, HEADS), kinds=[GroupKind(), window], dims=CPU_ATTENTION_PARTS)
    first = window.first_needed_block_token(N, 16)
    with pytest.raises(InvalidArgument, match=r"block_ids\[1\]=22 is also given to group 0, which shares its memory"):
        client.publish("r", [_blocks(0, 16, 5), _blocks(first, 16, 22)], N, first_tokens=[0, first])
    assert client.publish("r", [_blocks(0, 16, 5), _blocks(first, 16, 30)], N, first_tokens=[0, first]).generation > 0
