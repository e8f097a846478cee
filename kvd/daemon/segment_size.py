"""How big a pull's segments are: the wire's unit of pipelining, chosen by
where the bytes are (CPU or GPU, this host or another) and how they land."""

from __future__ import annotations

from kvd.core.pairing import in_wire_order
from kvd.daemon.config import DaemonConfig
from kvd.daemon.peers import Peer
from kvd.daemon.registration import Registration
from kvd.transport.tcp_client import TcpDataClient

# A segment is the wire's unit of pipelining. GPU to GPU on one host there is
# no wire, and a segment's own cost (its Python, launches and index upload,
# some 100 us) is what a 4 MiB device copy takes at 40 GB/s: measured on an
# H100, 4 MiB segments held that path to 12 GB/s against a 1.4 TB/s memcpy.
LOCAL_DEVICE_SEGMENT_BYTES = 64 << 20  # copied by one kernel where in wire order, else via GPU staging (samehost.copy_local)
# GPU memory over TCP: each segment is gathered on the GPU, copied to pinned
# memory, sent, received into pinned memory and relaid out on the GPU, with
# a fixed cost per step. On an H200 (256 MiB reads over 2 connections) 16 MiB
# segments moved 4.2-4.6 GB/s against 3.6-4.3 at 4 MiB and 3.6-4.5 at 32 MiB.
DEVICE_TCP_SEGMENT_BYTES = 16 << 20


def segment_bytes(config: DaemonConfig, data_client: TcpDataClient, reg: Registration, peer: Peer) -> int:
    """Bigger segments where every remote rank is mapped here and our memory
    is on a GPU, or where a TCP read lands in place (``IN_PLACE_SEGMENT_BYTES``)."""
    configured = config.segment_bytes
    on_gpu = all(t.device.type == "cuda" for t in reg.tensors)
    every_rank_local = len(peer.local_sources) == len(peer.meta.ranks)
    if on_gpu and every_rank_local and peer.local_sources:
        return max(configured, LOCAL_DEVICE_SEGMENT_BYTES)
    # Over TLS every frame is received into staging; on a GPU, too.
    plain_tcp = config.transport == "tcp" and data_client.tls is None
    if plain_tcp and on_gpu and not peer.local_sources:
        return max(configured, DEVICE_TCP_SEGMENT_BYTES)
    if plain_tcp and all(t.device.type == "cpu" for t in reg.tensors) and in_wire_order(reg.groups, peer.meta):
        return max(configured, config.in_place_segment_bytes)
    return configured
