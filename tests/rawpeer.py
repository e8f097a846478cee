"""A hand-driven data-plane peer: handshake over gRPC, then raw frames.

Used to test what a misbehaving or hostile reader can and cannot do."""

from __future__ import annotations

import socket

import grpc

from kvd.core.wire import HEADER_SIZE, FrameType, decode_header, encode
from kvd.proto import kvd_pb2 as pb
from kvd.proto import kvd_pb2_grpc as pbg


def fake_engine(engine_id: str = "intruder", *, layers: int = 4, heads: int = 4, head_size: int = 16, dtype: str = "bfloat16",
                block_size: int = 16, epoch: str = "e1") -> pb.EngineInfo:
    info = pb.EngineInfo(engine_id=engine_id, epoch=epoch, host_id="elsewhere", data_address="127.0.0.1:1", tp_size=1, pp_size=1,
                         model=pb.ModelInfo(num_layers=layers, total_num_kv_heads=heads))
    g = info.ranks.add(tp_rank=0, pp_rank=0).groups.add(
        group_id=0, spec=pb.KVCacheSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
                                        layout=["kv", "block", "token", "head", "dim"], num_blocks=64))
    for i in range(layers):
        g.layers.add(name=f"model.layers.{i}.attn", layer_index=i)
    return info


def handshake(grpc_address: str, info: pb.EngineInfo, metadata: tuple = ()) -> pb.HandshakeResponse:
    with grpc.insecure_channel(grpc_address) as ch:
        return pbg.PeerStub(ch).Handshake(pb.HandshakeRequest(caller=info), timeout=10, metadata=metadata)


class RawPeer:
    def __init__(self, data_address: str, timeout: float = 10.0) -> None:
        host, port = data_address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)

    def send(self, type_: FrameType, body: bytes = b"", tag: int = 0) -> None:
        self.sock.sendall(encode(type_, body, tag))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_frame(self) -> tuple[FrameType, int, bytes]:
        """(type, tag, body); raises ConnectionError when the daemon closed."""
        raw = self._recv(HEADER_SIZE)
        h = decode_header(raw)
        return h.type, h.tag, self._recv(h.length)

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed by the daemon")
            buf += chunk
        return bytes(buf)

    def hello(self, engine_id: str, epoch: str, data_token: bytes = b"", shared_token: bytes = b"") -> tuple[FrameType, bytes]:
        self.send(FrameType.HELLO, pb.DataHello(engine_id=engine_id, epoch=epoch, data_token=data_token, shared_token=shared_token).SerializeToString())
        t, _, body = self.recv_frame()
        return t, body

    def close(self) -> None:
        self.sock.close()
