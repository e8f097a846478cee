import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.wire import (
    HEADER_SIZE,
    MAX_CONTROL_BYTES,
    Connection,
    FrameType,
    Header,
    ProtocolError,
    decode_header,
    encode,
)


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
    c = Connection(server=True)
    with pytest.raises(ProtocolError):
        c.receive(Header(FrameType.READ, 0, 10))


def test_client_checks_segment_order_and_count():
    c = Connection(server=False)
    c.receive(Header(FrameType.HELLO_OK, 0, 0))
    c.sent(FrameType.READ, segments=2)
    c.receive(Header(FrameType.DATA, 0, 5))
    with pytest.raises(ProtocolError, match="out of order"):
        c.receive(Header(FrameType.DATA, 0, 5))


def test_end_before_all_segments_is_refused():
    c = Connection(server=False)
    c.receive(Header(FrameType.HELLO_OK, 0, 0))
    c.sent(FrameType.READ, segments=2)
    c.receive(Header(FrameType.DATA, 0, 5))
    with pytest.raises(ProtocolError, match="END after 1 of 2"):
        c.receive(Header(FrameType.END, 0, 0))


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE), st.booleans())
def test_arbitrary_headers_never_crash_the_parser(raw, server):
    c = Connection(server=server)
    with contextlib.suppress(ProtocolError):
        c.receive(decode_header(raw))
