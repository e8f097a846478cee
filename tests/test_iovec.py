"""Scatter/gather I/O: the iovec arithmetic against a byte-level model, and
the real syscalls (sendmsg/recvmsg over a socket pair, process_vm_readv on
our own pid) moving scattered pieces byte-exactly."""

from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.transport import iovec


def _pieces(buf: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    base = buf.ctypes.data
    return iovec.make([base + o for o, _ in spans], [n for _, n in spans])


def _bytes_of(buf: np.ndarray, iov: np.ndarray) -> bytes:
    base = buf.ctypes.data
    return b"".join(buf[int(a) - base:int(a) - base + int(n)].tobytes() for a, n in iov)


lengths = st.lists(st.integers(1, 40), min_size=1, max_size=12)


def _back_to_back(lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A buffer and an iovec of pieces of these lengths covering it in order."""
    buf = np.arange(sum(lens), dtype=np.uint8)
    ends = np.cumsum(lens)
    return buf, _pieces(buf, list(zip((ends - lens).tolist(), lens, strict=True)))


@settings(deadline=None)  # a slow example on a busy machine is no failure
@given(lengths, st.data())
def test_head_keeps_exactly_the_first_bytes(lens, data):
    buf, iov = _back_to_back(lens)
    count = data.draw(st.integers(0, sum(lens)))
    assert _bytes_of(buf, iovec.head(iov, count)) == buf.tobytes()[:count]
    # head then advance: the middle of the list, as a partial small answer sends it
    moved = data.draw(st.integers(0, count))
    assert _bytes_of(buf, iovec.advance(iovec.head(iov, count), moved)) == buf.tobytes()[moved:count]


@settings(deadline=None)  # a slow example on a busy machine is no failure
@given(lengths, st.data())
def test_advance_drops_exactly_the_moved_prefix(lens, data):
    buf, iov = _back_to_back(lens)
    moved = data.draw(st.integers(0, sum(lens)))
    rest = iovec.advance(iov, moved)
    assert _bytes_of(buf, rest) == buf.tobytes()[moved:]
    assert (rest[:, 1] > 0).all()


@settings(deadline=None)  # a slow example on a busy machine is no failure
@given(lengths, lengths)
def test_align_pairs_rows_of_equal_length_covering_the_same_bytes(a_lens, b_lens):
    total = min(sum(a_lens), sum(b_lens))
    def fit(lens):  # trim to a common total
        out, left = [], total
        for n in lens:
            if left <= 0:
                break
            out.append(min(n, left))
            left -= out[-1]
        return out
    a_lens, b_lens = fit(a_lens), fit(b_lens)
    a_buf, b_buf = np.arange(total, dtype=np.uint8), (np.arange(total, dtype=np.uint8) * 7).astype(np.uint8)
    a = _pieces(a_buf, [(sum(a_lens[:i]), n) for i, n in enumerate(a_lens)][::-1])  # pieces out of order in memory
    b = _pieces(b_buf, [(sum(b_lens[:i]), n) for i, n in enumerate(b_lens)])
    a2, b2 = iovec.align(a, b)
    assert (a2[:, 1] == b2[:, 1]).all()
    assert _bytes_of(a_buf, a2) == _bytes_of(a_buf, a)
    assert _bytes_of(b_buf, b2) == _bytes_of(b_buf, b)


def test_align_refuses_different_totals():
    buf = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="totals differ"):
        iovec.align(_pieces(buf, [(0, 8)]), _pieces(buf, [(0, 9)]))


def test_coalesce_merges_adjacent_runs_only():
    buf = np.arange(100, dtype=np.uint8)
    iov = _pieces(buf, [(0, 10), (10, 10), (30, 5), (35, 5), (20, 10)])
    merged = iovec.coalesce(iov)
    assert merged[:, 1].tolist() == [20, 10, 10]
    assert _bytes_of(buf, merged) == _bytes_of(buf, iov)


@settings(deadline=None, max_examples=30)
@given(st.lists(st.integers(1, 70_000), min_size=1, max_size=40), st.integers(0, 2**32))
def test_socket_pair_moves_scattered_pieces_byte_exact(sizes, seed):
    """sendmsg from pieces of one buffer, recvmsg (MSG_WAITALL) into pieces of
    another, in different orders; with a header ahead of the payload."""
    rnd = random.Random(seed)
    total = sum(sizes)
    src = np.frombuffer(rnd.randbytes(total), dtype=np.uint8).copy()
    dst = np.zeros(total, dtype=np.uint8)
    offs = np.cumsum([0, *sizes[:-1]])
    src_order, dst_order = list(range(len(sizes))), list(range(len(sizes)))
    rnd.shuffle(src_order)
    rnd.shuffle(dst_order)
    # The wire carries src pieces in src_order; the receiver lays the same
    # byte stream into dst pieces of the same sizes in dst_order.
    send_iov = _pieces(src, [(int(offs[i]), sizes[i]) for i in src_order])
    stream_sizes = [sizes[i] for i in src_order]
    dst_spans, cursor = [], 0
    for n in stream_sizes:
        dst_spans.append((cursor, n))
        cursor += n
    perm = [dst_spans[i] for i in dst_order]
    recv_iov = _pieces(dst, perm)
    a, b = socket.socketpair()
    try:
        head = b"HEAD"
        got: dict[str, object] = {}

        def receive() -> None:
            hdr = bytearray(4)
            b.recv_into(hdr, 4, socket.MSG_WAITALL)
            got["head"] = bytes(hdr)
            got["n"] = iovec.recv_all(b, recv_iov)

        t = threading.Thread(target=receive)
        t.start()
        sent = iovec.send_all(a, send_iov, head)
        t.join(timeout=30)
        assert got["head"] == head and sent == total and got["n"] == total
        stream = _bytes_of(src, send_iov)
        assert _bytes_of(dst, recv_iov) == stream
    finally:
        a.close()
        b.close()


def test_recv_all_reports_a_closed_peer_and_a_stall():
    a, b = socket.socketpair()
    buf = np.zeros(64, dtype=np.uint8)
    a.sendall(b"x" * 10)
    a.close()
    with pytest.raises(ConnectionResetError):
        iovec.recv_all(b, _pieces(buf, [(0, 64)]))
    b.close()
    a, b = socket.socketpair()
    try:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, np.array([0, 200_000], dtype=np.int64).tobytes())
        with pytest.raises(TimeoutError):
            iovec.recv_all(b, _pieces(buf, [(0, 64)]))
    finally:
        a.close()
        b.close()


@settings(deadline=None, max_examples=25)
@given(st.lists(st.integers(1, 50_000), min_size=1, max_size=30), st.integers(1, 4), st.sampled_from([1, 4 << 20]), st.integers(0, 2**32))
def test_copier_copies_piece_lists_byte_exact(sizes, threads, parallel_min_bytes, seed):
    """Split over threads (parallel_min_bytes=1) or kept on the caller."""
    copier = iovec.Copier(threads, parallel_min_bytes)
    try:
        if not copier.available:
            pytest.skip("process_vm_readv is refused here")
        rnd = random.Random(seed)
        total = sum(sizes)
        src = np.frombuffer(rnd.randbytes(total), dtype=np.uint8).copy()
        dst = np.zeros(total + 100, dtype=np.uint8)
        offs = np.cumsum([0, *sizes[:-1]])
        order = list(range(len(sizes)))
        rnd.shuffle(order)
        src_iov = _pieces(src, [(int(offs[i]), sizes[i]) for i in order])
        dst_iov = _pieces(dst, [(50, total)])  # one big destination piece: cut for the threads
        assert copier.copy(dst_iov, src_iov) == total
        assert dst[50:50 + total].tobytes() == _bytes_of(src, src_iov)
        assert not dst[:50].any() and not dst[50 + total:].any()
    finally:
        copier.close()


def test_copier_reports_unmapped_memory_as_an_error():
    copier = iovec.Copier(1)
    try:
        if not copier.available:
            pytest.skip("process_vm_readv is refused here")
        dst = np.zeros(64, dtype=np.uint8)
        with pytest.raises(OSError):
            copier.copy(_pieces(dst, [(0, 64)]), iovec.make([8], [64]))  # address 8 is never mapped
    finally:
        copier.close()


def test_send_nowait_stops_at_a_full_socket_and_the_rest_follows():
    """An owner writes a small read's whole answer (header, pieces, trailer)
    from its event loop: as much as the socket takes, the rest from a thread."""
    rnd = random.Random(3)
    sizes = [rnd.randrange(1, 300_000) for _ in range(40)]
    total = sum(sizes)
    src = np.frombuffer(rnd.randbytes(total), dtype=np.uint8).copy()
    offs = np.cumsum([0, *sizes[:-1]])
    order = list(range(len(sizes)))
    rnd.shuffle(order)
    iov, keep = iovec.chain([b"HEAD", _pieces(src, [(int(offs[i]), sizes[i]) for i in order]), b"TAIL"])
    assert iovec.nbytes(iov) == total + 8 and len(keep) == 2
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        sent = iovec.send_nowait(a, iov)  # nobody reads yet: the socket buffer fills
        assert 0 < sent < total
        assert iovec.send_nowait(a, iovec.advance(iov, sent)) == 0  # still full: no error, nothing sent
        out = bytearray()

        def receive() -> None:
            while len(out) < total + 8:
                out.extend(b.recv(1 << 20))

        t = threading.Thread(target=receive)
        t.start()
        a.setblocking(True)
        iovec.send_all(a, iovec.advance(iov, sent))
        t.join(timeout=30)
        assert bytes(out) == b"HEAD" + _bytes_of(src, _pieces(src, [(int(offs[i]), sizes[i]) for i in order])) + b"TAIL"
    finally:
        a.close()
        b.close()
