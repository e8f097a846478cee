"""iovec arrays: lists of (address, length) pieces of memory, as numpy.

An iovec array is ``np.ndarray`` of shape (n, 2), uint64, rows ``(address,
length)``: exactly Linux's ``struct iovec`` on 64-bit, so its buffer can be
handed to the kernel as is (``kvd.transport.iovec`` makes those syscalls).
Here is only the arithmetic: building, measuring, cutting and aligning lists,
vectorised, with no Python per piece.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IOV_MAX = 1024  # Linux's UIO_MAXIOV; larger lists are cut into calls of this many



def make(addrs: np.ndarray | Sequence[int], lens: np.ndarray | Sequence[int] | int) -> np.ndarray:
    out = np.empty((len(addrs), 2), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lens
    return out


def nbytes(iov: np.ndarray) -> int:
    return int(iov[:, 1].sum())


def coalesce(iov: np.ndarray) -> np.ndarray:
    """Merge rows that continue one another (a run of adjacent blocks) into one."""
    if len(iov) < 2:
        return iov
    breaks = np.flatnonzero(iov[1:, 0] != iov[:-1, 0] + iov[:-1, 1]) + 1
    if len(breaks) == len(iov) - 1:
        return iov
    starts = np.concatenate([np.zeros(1, dtype=np.int64), breaks])
    return make(iov[starts, 0], np.add.reduceat(iov[:, 1], starts))


def advance(iov: np.ndarray, moved: int) -> np.ndarray:
    """What remains of ``iov`` after the kernel moved its first ``moved`` bytes."""
    ends = np.cumsum(iov[:, 1])
    done = int(np.searchsorted(ends, moved, side="right"))
    rest = iov[done:].copy()
    if len(rest):
        into = moved - (int(ends[done - 1]) if done else 0)
        rest[0, 0] += np.uint64(into)
        rest[0, 1] -= np.uint64(into)
    return rest


def head(iov: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` bytes of ``iov``."""
    ends = np.cumsum(iov[:, 1])
    rows = int(np.searchsorted(ends, count, side="left")) + 1
    out = iov[:rows].copy()
    if len(out):
        out[-1, 1] -= np.uint64(int(ends[rows - 1]) - count)
    return out


def chunks(iov: np.ndarray, chunk_bytes: int) -> list[np.ndarray]:
    """``iov`` in consecutive parts of ``chunk_bytes`` (the last may be
    less), a piece cut where a part ends: what moves between two looks at
    the wire's order (``--qos on``)."""
    total = nbytes(iov)
    if total <= chunk_bytes:
        return [iov]
    ends = np.cumsum(iov[:, 1].astype(np.int64))
    starts = ends - iov[:, 1].astype(np.int64)
    out = []
    for lo in range(0, total, chunk_bytes):
        hi = min(lo + chunk_bytes, total)
        first, last = int(np.searchsorted(ends, lo, side="right")), int(np.searchsorted(starts, hi, side="left"))
        part = iov[first:last].copy()
        part[0, 0] += np.uint64(lo - starts[first])
        part[0, 1] -= np.uint64(lo - starts[first])
        part[-1, 1] -= np.uint64(ends[last - 1] - hi)
        out.append(part)
    return out


def align(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut two iovec lists of the same total at the union of their piece
    boundaries, so that row i of one pairs with row i of the other."""
    ea, eb = np.cumsum(a[:, 1]), np.cumsum(b[:, 1])
    if len(ea) and len(eb) and ea[-1] != eb[-1]:
        raise ValueError(f"iovec totals differ: {int(ea[-1])} and {int(eb[-1])} bytes")
    if len(ea) == len(eb) and np.array_equal(ea, eb):
        return a, b
    ends = np.union1d(ea, eb)
    starts = np.concatenate([np.zeros(1, dtype=np.uint64), ends[:-1]])
    lens = ends - starts

    def cut(iov: np.ndarray, e: np.ndarray) -> np.ndarray:
        row = np.searchsorted(e, starts, side="right")  # the piece each cut starts in
        offset_in = starts - (e[row] - iov[row, 1])
        return make(iov[row, 0] + offset_in, lens)

    return cut(a, ea), cut(b, eb)


def chain(parts: Sequence[bytes | np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Byte strings and iovec arrays, in order, as one iovec array; the
    second value holds the byte strings' buffers and must outlive its use."""
    keep = [np.frombuffer(p, dtype=np.uint8) for p in parts if isinstance(p, bytes)]
    it = iter(keep)
    rows = [make([next(it).ctypes.data], [len(p)]) if isinstance(p, bytes) else p for p in parts]
    return np.concatenate(rows), keep


def cut(iov: np.ndarray, parts: int) -> np.ndarray:
    """One piece cut into ``parts`` (page-aligned lengths where possible)."""
    addr, total = int(iov[0, 0]), int(iov[0, 1])
    step = max(4096, -(-total // parts) // 4096 * 4096)
    starts = np.arange(0, total, step, dtype=np.uint64)
    return make(addr + starts, np.minimum(step, total - starts))
