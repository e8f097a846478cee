import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.reads import DataRead, DataSegment
from kvd.core.session import Ack, Data, End, Error, Hello, HelloOk, Read, Session, State
from kvd.core.wire import (
    HEADER_SIZE,
    MAX_CONTROL_BYTES,
    FrameType,
    Header,
    ProtocolError,
    decode_header,
    encode,
)
from kvd.transport.codec import CODEC


def _read(segments: int) -> Read:
    segs = tuple(DataSegment(0, (0,), i, 1, 0, 16) for i in range(segments))
    return Read(DataRead("P", "r", 1, b"c" * 32, 0, 0, 0, 1, segs))


def _reader_reading(segments: int) -> Session:
    """A reader session past HELLO, its READ of ``segments`` sent."""
    c = Session(CODEC, owner=False)
    c.send(Hello("D", "e"))
    c.receive_header(Header(FrameType.HELLO_OK, 0, 0).encode())
    c.receive_body(b"")
    c.send(_read(segments))
    return c


def test_header_round_trip():
    h = Header(FrameType.DATA, 7, 1 << 20)
    assert decode_header(h.encode()) == h


def test_bad_frames_are_refused():
    with pytest.raises(ProtocolError, match="magic"):
        decode_header(b"XXXX" + encode(FrameType.HELLO)[4:])
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(Header(FrameType.READ, 0, MAX_CONTROL_BYTES + 1).encode())
    with pytest.raises(ProtocolError, match="bytes, expected"):
        decode_header(b"KVDP")


def test_server_requires_hello_before_read():
    c = Session(CODEC, owner=True)
    with pytest.raises(ProtocolError):
        c.receive_header(Header(FrameType.READ, 0, 10).encode())
    assert c.state is State.CLOSED


def test_client_checks_segment_order_and_count():
    c = _reader_reading(2)
    assert c.receive_header(Header(FrameType.DATA, 0, 5).encode()) == Data(0, 5)
    with pytest.raises(ProtocolError, match="out of order"):
        c.receive_header(Header(FrameType.DATA, 0, 5).encode())


def test_end_before_all_segments_is_refused():
    c = _reader_reading(2)
    c.receive_header(Header(FrameType.DATA, 0, 5).encode())
    with pytest.raises(ProtocolError, match="END after 1 of 2"):
        c.receive_header(Header(FrameType.END, 0, 0).encode())


def test_a_whole_read_round_trips_between_two_sessions():
    owner, reader = Session(CODEC, owner=True), Session(CODEC, owner=False)

    def deliver(frame: bytes, to: Session):
        head = to.receive_header(frame[:HEADER_SIZE])
        return head if isinstance(head, Data) else to.receive_body(frame[HEADER_SIZE:])

    assert deliver(reader.send(Hello("D", "e", b"t", lane="bulk")), owner) == Hello("D", "e", b"t", lane="bulk")
    assert deliver(owner.send(HelloOk()), reader) == HelloOk()
    read = _read(2)
    assert deliver(reader.send(read), owner) == read
    assert deliver(owner.send(Data(0, 7)), reader) == Data(0, 7)
    assert deliver(owner.send(Data(1, 7)), reader) == Data(1, 7)
    assert deliver(owner.send(End(14)), reader) == End(14)
    assert deliver(reader.send(Ack()), owner) == Ack()
    assert owner.state is State.IDLE and reader.state is State.IDLE
    with pytest.raises(ProtocolError, match="cannot send ACK"):
        reader.send(Ack())  # one ACK per END


def test_a_segment_is_confirmed_only_by_the_owners_next_frame():
    """The owner checks its publication alive before each frame after a DATA;
    until the next one arrives, the last segment may hold the blocks' reuse."""
    reader = _reader_reading(2)
    assert reader.unconfirmed is None
    reader.receive_header(Header(FrameType.DATA, 0, 5).encode())
    assert reader.unconfirmed == 0  # a cut here leaves segment 0 unconfirmed
    reader.receive_header(Header(FrameType.DATA, 1, 5).encode())
    assert reader.unconfirmed == 1  # DATA 1 confirmed segment 0
    end = CODEC.encode(End(10))
    reader.receive_header(Header(FrameType.END, 0, len(end)).encode())
    reader.receive_body(end)
    assert reader.unconfirmed is None  # END confirmed the last


def test_an_error_after_data_leaves_the_segment_sent_last_unconfirmed():
    reader = _reader_reading(3)
    reader.receive_header(Header(FrameType.DATA, 0, 5).encode())
    reader.receive_header(Header(FrameType.DATA, 1, 5).encode())
    frame = CODEC.encode(Error("ABORTED", "ended"))
    reader.receive_header(Header(FrameType.ERROR, 0, len(frame)).encode())
    assert reader.receive_body(frame) == Error("ABORTED", "ended")
    assert reader.unconfirmed == 1  # the reader un-lands it: segment 0 alone was confirmed (by DATA 1)
    # A refusal before any data invalidates nothing.
    fresh = _reader_reading(3)
    fresh.receive_header(Header(FrameType.ERROR, 0, len(frame)).encode())
    assert fresh.receive_body(frame) == Error("ABORTED", "ended") and fresh.unconfirmed is None


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE), st.booleans())
def test_arbitrary_headers_never_crash_the_parser(raw, owner):
    c = Session(CODEC, owner=owner)
    with contextlib.suppress(ProtocolError):
        c.receive_header(raw)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(FrameType)), st.binary(max_size=64))
def test_arbitrary_bodies_are_protocol_errors_not_crashes(type_, body):
    with contextlib.suppress(ProtocolError):
        CODEC.decode(type_, 0, body)
