"""Data-plane bounds: a stalled reader cannot grow the sender's memory, and
connection caps hold."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.core.wire import FrameType
from kvd.proto import kvd_pb2 as pb
from kvd.tools.bench_load import proc_status_bytes
from tests.conftest import make_worker
from tests.rawpeer import RawPeer, fake_engine, handshake

BIG = dict(layers=8, heads=4, head_size=128, num_blocks=1024)  # 256 MiB of cache


def rss(pid: int) -> int:
    return proc_status_bytes(pid, "VmRSS")


def test_stalled_reader_keeps_the_senders_memory_bounded(daemons):
    p = daemons.start("prefill")
    pw = make_worker(p.grpc, "prefill", **BIG)
    token = handshake(p.grpc, fake_engine("reader", layers=8, heads=4, head_size=128)).data_token
    ids = list(range(1, 1001))
    params = pw.client.publish("r", [ids], len(ids) * 16)
    before = rss(p.proc.pid)
    raw = RawPeer(p.info["data"])
    assert raw.hello("reader", "e1", token)[0] is FrameType.HELLO_OK
    read = pb.DataRead(owner_engine_id="prefill", request_id="r", generation=params.generation, capability=params.capability,
                       head_start=0, head_count=4)
    for b in range(1, 1001, 10):  # 100 gathered segments of 10 blocks x 8 layers x K+V: 250 MiB asked for
        read.segments.add(group_id=0, layers=list(range(8)), block_start=b, block_count=10, token_start=0, token_count=16)
    raw.send(FrameType.READ, read.SerializeToString())
    time.sleep(3)  # never read a byte
    grown = rss(p.proc.pid) - before
    assert grown < 48 << 20, f"sender grew {grown >> 20} MiB for a stalled reader"
    raw.close()
    with grpc.insecure_channel(p.grpc) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_connections_per_reader_are_capped(daemons):
    p = daemons.start("prefill")
    make_worker(p.grpc, "prefill")
    token = handshake(p.grpc, fake_engine("reader")).data_token
    peers = []
    for _ in range(16):
        raw = RawPeer(p.info["data"])
        assert raw.hello("reader", "e1", token)[0] is FrameType.HELLO_OK
        peers.append(raw)
    extra = RawPeer(p.info["data"])
    ftype, body = extra.hello("reader", "e1", token)
    assert ftype is FrameType.ERROR and b"RESOURCE_EXHAUSTED" in body
    for raw in peers:
        raw.close()
