"""The data plane's control bodies as protobuf (``kvd.proto``): the codec a
``kvd.core.session.Session`` is given, so the core never imports protobuf."""

from __future__ import annotations

from kvd.convert import descriptors_from_pb, descriptors_to_pb, read_from_pb, read_to_pb
from kvd.core.session import Ack, Descriptors, End, Error, Event, Hello, HelloOk, Read
from kvd.core.wire import FLAG_LOCAL, FLAG_NIXL, FrameType, ProtocolError
from kvd.proto import kvd_pb2 as pb


class PbCodec:
    def encode(self, event: Event) -> bytes:
        if isinstance(event, Hello):
            return pb.DataHello(engine_id=event.engine_id, epoch=event.epoch, data_token=event.data_token,
                                shared_token=event.shared_token, lane=event.lane).SerializeToString()
        if isinstance(event, Read):
            return read_to_pb(event.read).SerializeToString()
        if isinstance(event, End):
            return pb.DataEnd(bytes=event.bytes).SerializeToString()
        if isinstance(event, Error):
            return pb.DataError(code=event.code, message=event.message).SerializeToString()
        if isinstance(event, Descriptors):
            return descriptors_to_pb(event).SerializeToString()
        if isinstance(event, (HelloOk, Ack)):
            return b""
        raise ProtocolError(f"{type(event).__name__} has no control body")

    def decode(self, type_: FrameType, flags: int, body: bytes) -> Event:
        try:
            if type_ is FrameType.HELLO:
                h = pb.DataHello.FromString(body)
                return Hello(h.engine_id, h.epoch, h.data_token, h.shared_token, h.lane)
            if type_ is FrameType.HELLO_OK:
                return HelloOk()
            if type_ is FrameType.READ:
                return Read(read_from_pb(pb.DataRead.FromString(body)), local=bool(flags & FLAG_LOCAL), nixl=bool(flags & FLAG_NIXL))
            if type_ is FrameType.END:
                return End(pb.DataEnd.FromString(body).bytes)
            if type_ is FrameType.ERROR:
                e = pb.DataError.FromString(body)
                return Error(e.code, e.message)
            if type_ is FrameType.DESCS:
                return descriptors_from_pb(pb.DataDescriptors.FromString(body))
            if type_ is FrameType.ACK:
                return Ack()
        except Exception as e:  # DecodeError and worse: a peer that breaks the protocol
            raise ProtocolError(f"{type_.name} body does not decode: {e}") from None
        raise ProtocolError(f"{type_.name} has no control body")


CODEC = PbCodec()
