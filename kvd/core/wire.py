"""Data-plane frames: the fixed header, its codec and its limits (sans-I/O).

A frame is a fixed 20-byte header and a body::

    magic "KVDP" | version u8 | type u8 | flags u16 | tag u32 | length u64

Control bodies (HELLO, READ, ACK, END, ERROR, DESCS) are small messages the
shell's codec encodes; a DATA body is raw KV bytes, received straight into
its destination. The order of frames is ``kvd.core.session``'s.
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
