"""The gRPC edge's conversions: a peer's introduction, as the handshake carries it, and its abort."""

from __future__ import annotations

import random

from kvd.convert import engine_to_pb, introduction_from_pb, peer_abort_from_pb
from kvd.core.requests import Introduction, RankMemory, Region, ShmSource
from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo
from kvd.proto import kvd_pb2 as pb
from kvd.testing.sim import make_engine


def _same_host_introduction() -> Introduction:
    model = ModelInfo(4, 4)
    eng = make_engine("P", 2, 1, model, lambda _r: KVCacheSpec(16, 2, 8, "bfloat16", NAMED_LAYOUTS["NHD"], 32), random.Random(0))
    memory = tuple(RankMemory(t, p, (Region("r", 1 << 20, ShmSource(f"kvd-1-{t}")),), (r.group,), 7)
                   for (t, p), r in sorted(eng.ranks.items()))
    return Introduction(eng.meta, "fp", memory, b"t" * 32)


def test_a_same_host_introduction_crosses_whole():
    intro = _same_host_introduction()
    back = introduction_from_pb(engine_to_pb(intro), intro.data_token)
    assert back.memory_refused == ""
    assert back.memory == intro.memory  # regions, tensor views and registration, every rank
    assert back.meta.engine_id == "P" and back.data_token == intro.data_token


def test_memory_this_daemon_refuses_leaves_the_engine_met_and_says_why():
    # A peer's tensor view this daemon rejects (a malformed peer, or rules that
    # changed between releases) must not fail the handshake: the reader reads over TCP.
    intro = _same_host_introduction()
    msg = engine_to_pb(intro)
    msg.ranks[1].groups[0].layers[0].tensors[0].shape[0] += 1
    back = introduction_from_pb(msg, intro.data_token)
    assert back.memory == () and "shape" in back.memory_refused
    assert back.meta == introduction_from_pb(engine_to_pb(intro)).meta


def test_a_peers_abort_reason_arrives_as_one_line():
    """P logs it (``reader released ... : <reason>``): a line break in it would forge a log line."""
    msg = pb.PeerAbortRequest(engine_id="P", request_id="r", reason="failed to load it\nts=x level=error msg=forged\r\nend")
    assert peer_abort_from_pb(msg).reason == "failed to load it ts=x level=error msg=forged end"
    plain = pb.PeerAbortRequest(engine_id="P", request_id="r", reason="reader decode failed to load it: x=1 (y)")
    assert peer_abort_from_pb(plain).reason == plain.reason  # control: a one-line reason is kept as sent
