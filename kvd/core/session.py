"""One side of a data-plane connection, sans I/O (h11's ``Connection`` is the model).

Bytes in, events out: ``receive_header`` takes a frame's 20 header bytes
and, for a control frame, ``receive_body`` its body, returning an event.
Events in, bytes out: ``send`` takes an event and returns the frame to
write. The whole frame sequence lives here once, as transition tables:

    reader                              owner
    HELLO            ------------->
                     <-------------     HELLO_OK | ERROR
    READ (flags)     ------------->
                     <-------------     DATA x n | DESCS, then END | ERROR
    ACK              ------------->     (after END only)

A DATA frame's payload never passes through here: ``receive_header``
returns ``Data(tag, length)`` and the driver receives the bytes straight
into their destination, as the owner sends them straight from registered
memory after ``send(Data(...))`` gave it the header. Control bodies are
encoded by a ``BodyCodec`` the shell supplies (protobuf there), so the core
never sees a wire library. Anything out of place raises ``ProtocolError``,
and the connection must be closed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvd.core.errors import KvdError
from kvd.core.reads import DataRead
from kvd.core.wire import (
    FLAG_LOCAL,
    FLAG_NIXL,
    HEADER_SIZE,
    FrameType,
    Header,
    ProtocolError,
    decode_header,
)

# ---------------------------------------------------------------- events

@dataclass(frozen=True)
class Hello:
    engine_id: str
    epoch: str
    data_token: bytes = b""  # from the owner's handshake
    shared_token: bytes = b""  # auth=token: the cluster's bearer token
    lane: str = ""  # the reads the connection carries: "bulk", "interactive", "" (any class; see DataHello.lane)


@dataclass(frozen=True)
class HelloOk:
    pass


@dataclass(frozen=True)
class Read:
    read: DataRead
    local: bool = False  # same host: authorise only; the reader copies, END has no DATA before it
    nixl: bool = False  # answer with one DESCS frame (where the bytes lie), then END

    @property
    def flags(self) -> int:
        return (FLAG_LOCAL if self.local else 0) | (FLAG_NIXL if self.nixl else 0)

    @property
    def via(self) -> str:
        """The byte mover this read asks for: ``samehost``, ``nixl`` or ``tcp`` (DATA frames)."""
        return "samehost" if self.local else "nixl" if self.nixl else "tcp"


@dataclass(frozen=True)
class Data:
    """One segment's bytes follow: ``length`` of them, for segment ``tag``."""

    tag: int
    length: int


@dataclass(frozen=True)
class Descriptors:
    """transport nixl: where every segment lies in the owner's NIXL-registered
    memory: ``counts[i]`` descriptors (``addrs``, ``lengths``) for segment ``i``
    (empty: one each); the agent's metadata only where the reader's is stale."""

    agent_name: str
    addrs: np.ndarray  # uint64
    lengths: np.ndarray  # uint64
    counts: np.ndarray  # int64
    agent_metadata: bytes = b""
    metadata_version: int = 0


@dataclass(frozen=True)
class End:
    bytes: int = 0


@dataclass(frozen=True)
class Error:
    code: str  # a Status name, e.g. PERMISSION_DENIED
    message: str

    @classmethod
    def of(cls, e: KvdError) -> Error:
        return cls(e.status.name, e.message)


@dataclass(frozen=True)
class Ack:
    pass


Event = Hello | HelloOk | Read | Data | Descriptors | End | Error | Ack


class BodyCodec(Protocol):
    """Control frame bodies <-> events (the shell's wire format)."""

    def encode(self, event: Event) -> bytes: ...

    def decode(self, type_: FrameType, flags: int, body: bytes) -> Event: ...


# ---------------------------------------------------------------- states

class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    IDLE = "idle"  # between reads
    READING = "reading"  # a READ is being served
    AWAIT_ACK = "await_ack"
    CLOSED = "closed"


_TYPE: dict[type, FrameType] = {
    Hello: FrameType.HELLO, HelloOk: FrameType.HELLO_OK, Read: FrameType.READ, Data: FrameType.DATA,
    Descriptors: FrameType.DESCS, End: FrameType.END, Error: FrameType.ERROR, Ack: FrameType.ACK,
}

# (state, frame) -> next state, for the frames each side may receive, and
# for the frames each side may send.
_OWNER_RX: dict[tuple[State, FrameType], State] = {
    (State.AWAIT_HELLO, FrameType.HELLO): State.IDLE,
    (State.IDLE, FrameType.READ): State.READING,
    (State.AWAIT_ACK, FrameType.ACK): State.IDLE,
}
_READER_RX: dict[tuple[State, FrameType], State] = {
    (State.AWAIT_HELLO, FrameType.HELLO_OK): State.IDLE,
    (State.AWAIT_HELLO, FrameType.ERROR): State.CLOSED,
    (State.READING, FrameType.DATA): State.READING,
    (State.READING, FrameType.DESCS): State.READING,
    (State.READING, FrameType.END): State.AWAIT_ACK,
    (State.READING, FrameType.ERROR): State.IDLE,
}
_OWNER_TX: dict[tuple[State, FrameType], State] = {
    (State.IDLE, FrameType.HELLO_OK): State.IDLE,
    (State.IDLE, FrameType.ERROR): State.CLOSED,  # a refused HELLO
    (State.READING, FrameType.DATA): State.READING,
    (State.READING, FrameType.DESCS): State.READING,
    (State.READING, FrameType.END): State.AWAIT_ACK,
    (State.READING, FrameType.ERROR): State.IDLE,
}
_READER_TX: dict[tuple[State, FrameType], State] = {
    (State.AWAIT_HELLO, FrameType.HELLO): State.AWAIT_HELLO,
    (State.IDLE, FrameType.READ): State.READING,
    (State.AWAIT_ACK, FrameType.ACK): State.IDLE,
}


class Session:
    """One side of one data connection: ``owner`` serves reads, else it reads."""

    def __init__(self, codec: BodyCodec, *, owner: bool) -> None:
        self.codec = codec
        self.owner = owner
        self.state = State.AWAIT_HELLO
        self.segments_expected = 0
        self.segments_seen = 0
        # The reader's last DATA segment until the owner's next frame (DATA or
        # END), sent only after the publication was seen alive, confirms it:
        # the engine may reuse blocks the moment it ends, so an unconfirmed
        # segment may hold bytes of the reuse and does not count as landed.
        self.unconfirmed: int | None = None
        self._rx = _OWNER_RX if owner else _READER_RX
        self._tx = _OWNER_TX if owner else _READER_TX
        self._pending: Header | None = None  # a control header whose body is due

    # ------------------------------------------------------------ bytes in

    def receive_header(self, raw: bytes | bytearray | memoryview) -> Header | Data:
        """A frame's header. DATA comes back as its event (the payload is the
        driver's to place); a control frame as its header, whose ``length``
        bytes of body go to ``receive_body`` next."""
        if self._pending is not None:
            raise ProtocolError("a header arrived while a body was due")
        header = decode_header(raw)
        nxt = self._rx.get((self.state, header.type))
        if nxt is None:
            return self._fail(f"{header.type.name} not allowed in state {self.state.value}")
        if header.type is FrameType.DATA:
            if header.tag != self.segments_seen or self.segments_seen >= self.segments_expected:
                return self._fail(f"DATA tag {header.tag} out of order (expected {self.segments_seen} of {self.segments_expected})")
            self.segments_seen += 1
            self.unconfirmed = header.tag
            self.state = nxt
            return Data(header.tag, header.length)
        if header.type is FrameType.DESCS and self.segments_seen:
            return self._fail("DESCS after DATA")
        if header.type is FrameType.END and self.segments_seen != self.segments_expected:
            return self._fail(f"END after {self.segments_seen} of {self.segments_expected} segments")
        self._pending = header
        return header

    def receive_body(self, body: bytes) -> Event:
        """The body of the control frame ``receive_header`` announced."""
        header, self._pending = self._pending, None
        if header is None:
            return self._fail("a body arrived with no header before it")
        if len(body) != header.length:
            return self._fail(f"{header.type.name} body of {len(body)} bytes, header said {header.length}")
        event = self.codec.decode(header.type, header.flags, body)
        self.state = self._rx[(self.state, header.type)]
        if isinstance(event, Descriptors):
            self.segments_seen = self.segments_expected  # one frame describes them all
        elif isinstance(event, Read):
            self._begin(event)
        elif isinstance(event, End):
            self.unconfirmed = None
        return event  # after an ERROR, ``unconfirmed`` is the segment it leaves not landed

    # ------------------------------------------------------------ events in, bytes out

    def send(self, event: Event) -> bytes:
        """The frame for ``event``; for DATA only its header (the payload
        follows from where it lies)."""
        type_ = _TYPE[type(event)]
        nxt = self._tx.get((self.state, type_))
        if nxt is None:
            side = "owner" if self.owner else "reader"
            raise ProtocolError(f"the {side} cannot send {type_.name} in state {self.state.value}")
        if isinstance(event, Data):
            self.state = nxt
            return Header(FrameType.DATA, event.tag, event.length).encode()
        body = b"" if isinstance(event, (HelloOk, Ack)) else self.codec.encode(event)
        flags = event.flags if isinstance(event, Read) else 0
        if isinstance(event, Read):
            self._begin(event)
        self.state = nxt
        return Header(type_, 0, len(body), flags).encode() + body

    # ------------------------------------------------------------ helpers

    def _begin(self, event: Read) -> None:
        # A same-host read is answered by END alone: no segment crosses.
        self.segments_expected = 0 if event.local else len(event.read.segments)
        self.segments_seen = 0
        self.unconfirmed = None

    def _fail(self, why: str):  # type: ignore[no-untyped-def]
        self.state = State.CLOSED
        raise ProtocolError(why)


__all__ = [
    "HEADER_SIZE", "Ack", "BodyCodec", "Data", "Descriptors", "End", "Error", "Event", "Hello", "HelloOk",
    "ProtocolError", "Read", "Session", "State",
]
