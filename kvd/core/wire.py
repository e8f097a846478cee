"""Data-plane frame codec and connection state machine (sans-I/O).

A frame is a fixed 20-byte header and a body::

    magic "KVDP" | version u8 | type u8 | flags u16 | tag u32 | length u64

Control bodies (HELLO, READ, ACK, END, ERROR) are small protobuf messages from
kvd.proto. A DATA body is raw KV bytes; the shell receives it straight into its
destination, so this module only validates the header and the order of frames
and never touches payload bytes. Like h11, ``Connection`` turns headers into
state transitions and raises ``ProtocolError`` on anything out of place; it can
be driven (and fuzzed) without a socket.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"KVDP"
VERSION = 1
HEADER = struct.Struct("!4sBBHIQ")
HEADER_SIZE = HEADER.size
MAX_CONTROL_BYTES = 1 << 20  # a READ of ~40k segments fits; larger is refused
MAX_DATA_BYTES = 1 << 31

# READ flag: a same-host read. The owner authorises it and answers END with no
# DATA; the reader copies straight from the owner's memory, which it has mapped.
FLAG_LOCAL = 1
# READ flag for transport nixl: answer with one DESCS frame (then END) instead
# of DATA frames.
FLAG_NIXL = 2


class FrameType(enum.IntEnum):
    HELLO = 1  # client -> server: who I am (and, with auth on, my credential)
    HELLO_OK = 2  # server -> client
    READ = 3  # client -> server: a DataRead
    DATA = 4  # server -> client: one segment's bytes, tag = segment index
    END = 5  # server -> client: the read is complete
    ERROR = 6  # server -> client: the read is refused or failed (DataError)
    ACK = 7  # client -> server: every byte of the read has landed
    DESCS = 8  # server -> client: where every segment lies, for a NIXL READ (DataDescriptors)


CONTROL = frozenset(FrameType) - {FrameType.DATA}


class ProtocolError(Exception):
    """The peer broke the protocol; the connection must be closed."""


@dataclass(frozen=True)
class Header:
    type: FrameType
    tag: int
    length: int
    flags: int = 0

    def encode(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, int(self.type), self.flags, self.tag, self.length)


def encode(type_: FrameType, body: bytes = b"", tag: int = 0) -> bytes:
    return Header(type_, tag, len(body)).encode() + body


def decode_header(raw: bytes | bytearray | memoryview) -> Header:
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(raw)} bytes, expected {HEADER_SIZE}")
    magic, version, type_, flags, tag, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported version {version}")
    try:
        ftype = FrameType(type_)
    except ValueError:
        raise ProtocolError(f"unknown frame type {type_}") from None
    limit = MAX_DATA_BYTES if ftype is FrameType.DATA else MAX_CONTROL_BYTES
    if length > limit:
        raise ProtocolError(f"{ftype.name} frame of {length} bytes exceeds the {limit}-byte limit")
    return Header(ftype, tag, length, flags)


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    IDLE = "idle"  # between reads
    READING = "reading"  # a READ is being served
    AWAIT_ACK = "await_ack"
    CLOSED = "closed"


# Which frames each side may *receive* in each state, and the state after.
_SERVER_RX: dict[tuple[State, FrameType], State] = {
    (State.AWAIT_HELLO, FrameType.HELLO): State.IDLE,
    (State.IDLE, FrameType.READ): State.READING,
    (State.AWAIT_ACK, FrameType.ACK): State.IDLE,
}
_CLIENT_RX: dict[tuple[State, FrameType], State] = {
    (State.AWAIT_HELLO, FrameType.HELLO_OK): State.IDLE,
    (State.READING, FrameType.DATA): State.READING,
    (State.READING, FrameType.DESCS): State.READING,
    (State.READING, FrameType.END): State.AWAIT_ACK,
    (State.READING, FrameType.ERROR): State.IDLE,
    (State.AWAIT_HELLO, FrameType.ERROR): State.CLOSED,
}


class Connection:
    """One side of a data-plane connection: tracks state, validates frames.

    The server's transitions on what it *sends* (END -> await ACK, ERROR ->
    idle) are applied with ``sent``; the client's READ and ACK likewise.
    """

    def __init__(self, server: bool) -> None:
        self.server = server
        self.state = State.AWAIT_HELLO
        self.segments_expected = 0
        self.segments_seen = 0

    def receive(self, header: Header) -> Header:
        table = _SERVER_RX if self.server else _CLIENT_RX
        nxt = table.get((self.state, header.type))
        if nxt is None:
            self.state = State.CLOSED
            raise ProtocolError(f"{header.type.name} not allowed in state {self.state.value}")
        if header.type is FrameType.DATA:
            if header.tag != self.segments_seen or self.segments_seen >= self.segments_expected:
                self.state = State.CLOSED
                raise ProtocolError(f"DATA tag {header.tag} out of order (expected {self.segments_seen} of {self.segments_expected})")
            self.segments_seen += 1
        if header.type is FrameType.DESCS:
            if self.segments_seen:
                self.state = State.CLOSED
                raise ProtocolError("DESCS after DATA")
            self.segments_seen = self.segments_expected  # one frame describes them all
        if header.type is FrameType.END and self.segments_seen != self.segments_expected:
            self.state = State.CLOSED
            raise ProtocolError(f"END after {self.segments_seen} of {self.segments_expected} segments")
        self.state = nxt
        return header

    def sent(self, type_: FrameType, segments: int = 0) -> None:
        if self.server:
            if type_ is FrameType.HELLO_OK and self.state is State.IDLE:
                return
            if type_ is FrameType.END and self.state is State.READING:
                self.state = State.AWAIT_ACK
            elif type_ is FrameType.ERROR:
                self.state = State.IDLE if self.state is State.READING else State.CLOSED
            elif type_ in (FrameType.DATA, FrameType.DESCS) and self.state is State.READING:
                return
            else:
                raise ProtocolError(f"server cannot send {type_.name} in state {self.state.value}")
        else:
            if type_ is FrameType.HELLO and self.state is State.AWAIT_HELLO:
                return
            if type_ is FrameType.READ and self.state is State.IDLE:
                self.state = State.READING
                self.segments_expected, self.segments_seen = segments, 0
            elif type_ is FrameType.ACK and self.state is State.AWAIT_ACK:
                self.state = State.IDLE
            else:
                raise ProtocolError(f"client cannot send {type_.name} in state {self.state.value}")
