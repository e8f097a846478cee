"""Mixed kvd versions, as a rolling upgrade leaves them (``pytest -m upgrade``).

The previous release is found through CHANGELOG.md (a clone may carry no
tags), checked out from git into a worktree and run beside this tree: its
daemon as prefill and this one as decode, and the reverse. Blocks move and
verify both ways. A feature only this release has (a state part replicated
over TP ranks) is refused by name by the older daemon, never broken; a
peer whose wire protocol is more than one version away is refused at the
handshake with both versions named.
"""

from __future__ import annotations

import grpc
import pytest

import kvd
from kvd.client import daemon_status
from kvd.core.engine_meta import WIRE_VERSION
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg
from tests.conftest import REPO, make_worker
from tests.release_support import previous_release, releases

pytestmark = [pytest.mark.upgrade, pytest.mark.slow]

def test_the_changelog_names_releases_and_this_tree_is_newer():
    found = releases()
    assert found and all(len(c) >= 7 for _, c in found)
    assert previous_release()[0] != kvd.__version__


@pytest.mark.parametrize("old_side", ["prefill", "decode"])
def test_blocks_move_between_this_release_and_the_previous_both_ways(daemons, previous, old_side):
    version, tree = previous
    p = daemons.start("prefill", source=tree if old_side == "prefill" else REPO)
    d = daemons.start("decode", source=tree if old_side == "decode" else REPO)
    versions = {daemon_status(p.grpc).version, daemon_status(d.grpc).version}
    assert versions == {version, kvd.__version__}, versions
    pw, dw = make_worker(p.grpc, "prefill", tp_size=1), make_worker(d.grpc, "decode", block_size=32, layout="HND")
    ids = list(range(1, 21))
    pw.fill(7, ids)
    params = pw.client.publish("r", [ids], len(ids) * 16 - 3)
    d_ids = list(range(30, 40))
    dw.client.pull("r", params, [d_ids])
    f = dw.client.wait_finished(recving={"r"}, timeout=30)
    assert f.details[("recving", "r")].outcome == "done", f.details
    assert dw.mismatch(7, d_ids, len(ids) * 16 - 3) is None  # relaid out (NHD 16 -> HND 32) across versions, byte exact
    assert pw.client.wait_finished(sending={"r"}, timeout=10).details[("sending", "r")].outcome == "done"
    # Negative control: a block the request did not cover holds nothing of it.
    assert dw.mismatch(7, [50], 16) is not None


def test_a_feature_only_this_release_has_is_refused_by_name_by_the_previous(daemons, previous):
    """A Mamba2 state part replicated over TP2 (``n_groups=1``, B and C on
    both ranks) is new in 0.2.0: the previous release's decode daemon cannot
    pair it with its TP1 and says so, naming the group and both values."""
    from kvd.caches import allocate_state_pages
    from kvd.client import KvdClient
    from kvd.core.groups import STATE_PART
    from kvd.spec import ModelInfo, WorkerId
    from kvd.state_parts import mamba2

    _version, tree = previous
    p, d = daemons.start("prefill"), daemons.start("decode", source=tree)
    shape = mamba2(num_heads=8, head_dim=4, n_groups=1, d_state=8, conv_kernel=4, dtype="float32")
    names = ["model.layers.0.mixer", "model.layers.1.mixer"]
    clients = {}
    for side, address, tp in (("prefill", p.grpc, 2), ("decode", d.grpc, 1)):
        for rank in range(tp):
            parts = shape.layer_parts(allocate_state_pages(names, 8, shape.page_bytes(tp)), tp)
            c = KvdClient(address, WorkerId(side, rank, tp))
            c.wait_ready()
            c.register(parts, ModelInfo(2, 0), kinds=[STATE_PART] * len(parts))
            clients[(side, rank)] = c
    params = clients[("prefill", 0)].publish("r", [[3]] * 4, 100)
    clients[("prefill", 1)].publish("r", [[3]] * 4, 100, capability=params.capability)
    clients[("decode", 0)].pull("r", params, [[5]] * 4)
    f = clients[("decode", 0)].wait_finished(recving={"r"}, timeout=30)
    detail = f.details[("recving", "r")]
    assert detail.outcome == "failed" and "group[1].total_heads: local=1 remote=2" in detail.reason, detail.reason


def test_a_wire_version_two_away_is_refused_at_the_handshake_naming_both(daemons):
    p = daemons.start("prefill")
    make_worker(p.grpc, "prefill")
    stub = pbg.PeerStub(grpc.insecure_channel(p.grpc))
    future = pb.EngineInfo(engine_id="decode", epoch="e", host_id="h", data_address="127.0.0.1:1", tp_size=1, pp_size=1,
                           model=pb.ModelInfo(num_layers=4, total_num_kv_heads=4), kvd_version="9.0.0", wire_version=WIRE_VERSION + 2)
    with pytest.raises(grpc.RpcError) as e:
        stub.Handshake(pb.HandshakeRequest(caller=future), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"wire_version: local='{WIRE_VERSION} (kvd {kvd.__version__})' remote='{WIRE_VERSION + 2} (kvd 9.0.0)'" in e.value.details(), e.value.details()
    # Negative control: one version up is talked to (refused only for what else differs, not the wire).
    future.wire_version = WIRE_VERSION + 1
    with pytest.raises(grpc.RpcError) as e:
        stub.Handshake(pb.HandshakeRequest(caller=future), timeout=10)
    assert "wire_version" not in e.value.details(), e.value.details()


def test_an_owner_lists_per_reader_acks_in_its_handshake(daemons):
    """A reader cuts reads by qos_read_bytes only from an owner that lists
    ``per-reader-acks`` (it counts each reader's ACKs against that reader's
    own stripes; kvd 0.2.0 did not, and ended a rank a stripe early when
    readers cut theirs differently): a current owner lists it, or every pull
    of it would silently lose the cap."""
    import random

    from kvd.convert import engine_to_pb
    from kvd.core.engine_meta import LAYER_STREAM, PER_READER_ACKS, fingerprint
    from kvd.core.requests import Introduction
    from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
    from kvd.testing.sim import make_engine

    p = daemons.start("prefill")
    make_worker(p.grpc, "prefill")  # conftest's defaults: 4 layers, 4 heads of 16, 16-token blocks, bf16 NHD
    reader = make_engine("decode", 1, 1, ModelInfo(4, 4), lambda r: KVCacheSpec(16, 4, 16, "bfloat16", NAMED_LAYOUTS["NHD"], 64),
                         random.Random(0), fill=False).meta
    caller = engine_to_pb(Introduction(reader, fingerprint(reader.model, reader.ranks[0].groups)))
    callee = pbg.PeerStub(grpc.insecure_channel(p.grpc)).Handshake(pb.HandshakeRequest(caller=caller), timeout=10).callee
    assert {LAYER_STREAM, PER_READER_ACKS} <= set(callee.features), list(callee.features)
