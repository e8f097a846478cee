"""Scatter/gather I/O over numpy iovec arrays: one syscall moves up to 1024
pieces of registered memory, with no Python per piece (a same-host copy of
pieces of 256 KiB and more takes one ``memmove`` call each instead).

An iovec array is ``np.ndarray`` of shape (n, 2), uint64, rows ``(address,
length)``: exactly Linux's ``struct iovec`` on 64-bit, so its buffer is
handed to the kernel as is. The arithmetic (``advance``, ``align``, ``split``)
is pure; ``send_all``, ``recv_all`` and ``Copier`` make the syscalls through
ctypes, which drops the GIL for their duration.

Why: a block of one layer is 16-64 KiB in real engines. Gathering scattered
blocks into staging and scattering them back out costs a memory pass on each
side (``index_copy_`` scatters at a fraction of memcpy speed), and a Python
call per block costs more than the copy. ``sendmsg``/``recvmsg`` with
MSG_WAITALL move the pieces straight between registered memory and the
socket, and ``process_vm_readv`` on our own pid copies piece lists between
two mapped regions in one pass (UCX's CMA transport does the same).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import os
import socket
import threading
from typing import TYPE_CHECKING

import numpy as np

from kvd.core.iov import IOV_MAX, advance, align, chain, coalesce, cut, head, make, nbytes

if TYPE_CHECKING:  # imported where a Copier makes its own pool: copy_threads imports torch (2 s), which a syscall does not need
    from kvd.transport.copy_threads import CopyThreads

__all__ = ["IOV_MAX", "Copier", "advance", "align", "chain", "coalesce", "cut", "head", "make", "nbytes", "recv_all", "send_all", "send_nowait"]

# ------------------------------------------------------------------ syscalls

class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p), ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.sendmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
_libc.sendmsg.restype = ctypes.c_ssize_t
_libc.recvmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
_libc.recvmsg.restype = ctypes.c_ssize_t
_vm_readv = getattr(_libc, "process_vm_readv", None)
if _vm_readv is not None:
    _vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _vm_readv.restype = ctypes.c_ssize_t

_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def _raise(op: str) -> None:
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK):
        raise TimeoutError(f"{op} stalled past the socket's timeout")
    if err in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
        raise ConnectionResetError(err, f"{op}: {os.strerror(err)}")
    raise OSError(err, f"{op}: {os.strerror(err)}")


def _transfer(fd: int, iov: np.ndarray, send: bool, wait: bool = True) -> int:
    """Move all of ``iov`` over a blocking socket; returns bytes moved.
    Without ``wait`` (sends only), stop where the socket would block."""
    call, flags, op = (_libc.sendmsg, _MSG_NOSIGNAL, "sendmsg") if send else (_libc.recvmsg, socket.MSG_WAITALL, "recvmsg")
    if not wait:
        flags |= socket.MSG_DONTWAIT
    total = 0
    while len(iov):
        chunk = np.ascontiguousarray(iov[:IOV_MAX])
        hdr = _MsgHdr(None, 0, chunk.ctypes.data, len(chunk), None, 0, 0)
        k = call(fd, ctypes.byref(hdr), flags)
        if k < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if not wait and err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return total
            _raise(op)
        if k == 0 and not send:
            raise ConnectionResetError("peer closed the connection")
        total += k
        iov = iov[len(chunk):] if k == nbytes(chunk) else advance(iov, k)
    return total


def send_all(sock: socket.socket, iov: np.ndarray, head: bytes = b"") -> int:
    """Write ``head`` then every piece of ``iov`` (a blocking socket: its
    SO_SNDTIMEO bounds a stall). Returns payload bytes sent."""
    if head:
        whole, _keep = chain([head, iov])
        return _transfer(sock.fileno(), whole, send=True) - len(head)
    return _transfer(sock.fileno(), iov, send=True)


def send_nowait(sock: socket.socket, iov: np.ndarray) -> int:
    """Write as much of ``iov`` as the socket takes without blocking; returns
    the bytes written (``advance`` gives the rest)."""
    return _transfer(sock.fileno(), iov, send=True, wait=False)


def recv_all(sock: socket.socket, iov: np.ndarray) -> int:
    """Fill every piece of ``iov`` from a blocking socket (MSG_WAITALL: one
    syscall per up to 1024 pieces, however the bytes arrive)."""
    return _transfer(sock.fileno(), iov, send=False)


# Pieces at least this long are copied by ``memmove``: ``process_vm_readv``
# pins every page it copies, and on two threads moved 1 MiB pieces at 0.86x a
# one-thread memcpy where ``memmove`` moved them at 1.5x. Below it, a Python
# call per piece costs more than the pinning (16 KiB pieces: 0.5x against
# 0.3-0.6x); at 256 KiB the call is about 1% of the piece's copy.
MEMMOVE_MIN_PIECE = 256 << 10


class Copier:
    """Copies between two iovec lists of this process's memory with
    ``process_vm_readv`` on our own pid (pieces of ``MEMMOVE_MIN_PIECE`` and
    more with ``memmove``), split over a few threads.

    One pass, with no gather or scatter buffer; on 2 cores two threads copy
    faster than one memcpy. ``available`` is False where the syscall is
    refused (seccomp, old kernels), and callers fall back to torch copies."""

    def __init__(self, threads: int = 2, parallel_min_bytes: int = 4 << 20, pool: CopyThreads | None = None) -> None:
        # The daemon's copy threads (``pool``), shared with relayouts, or our own.
        self._owned = pool is None
        if pool is None:
            from kvd.transport.copy_threads import CopyThreads

            pool = CopyThreads(threads)
        self._threads = pool
        self.threads = self._threads.threads
        # Each thread gets at least this much: waking a helper thread costs
        # more than it saves on a small copy, which stays on the caller.
        self.parallel_min_bytes = max(1, parallel_min_bytes)
        self.available = self._probe()

    def _probe(self) -> bool:
        if _vm_readv is None:
            return False
        src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
        try:
            self._copy_rows(make([dst.ctypes.data], [64]), make([src.ctypes.data], [64]), None)
        except OSError:
            return False
        return bool((src == dst).all())

    @staticmethod
    def _copy_rows(dst: np.ndarray, src: np.ndarray, cancel: threading.Event | None) -> None:
        """Copy aligned rows (row i of ``src`` into row i of ``dst``, the same
        length): big ones by ``memmove``, one call each; the rest by
        ``process_vm_readv``, up to 1024 a call."""
        big = dst[:, 1] >= MEMMOVE_MIN_PIECE
        if big.any():
            for d, s, n in zip(dst[big, 0].tolist(), src[big, 0].tolist(), dst[big, 1].tolist(), strict=True):
                if cancel is not None and cancel.is_set():
                    raise ConnectionAbortedError("copy abandoned")
                ctypes.memmove(d, s, n)  # drops the GIL
            dst, src = dst[~big], src[~big]
        pid = os.getpid()
        for lo in range(0, len(dst), IOV_MAX):
            if cancel is not None and cancel.is_set():
                raise ConnectionAbortedError("copy abandoned")
            d, s = np.ascontiguousarray(dst[lo:lo + IOV_MAX]), np.ascontiguousarray(src[lo:lo + IOV_MAX])
            want = nbytes(d)
            while want:
                assert _vm_readv is not None
                k = _vm_readv(pid, d.ctypes.data, len(d), s.ctypes.data, len(s), 0)
                if k < 0:
                    if ctypes.get_errno() == errno.EINTR:
                        continue
                    _raise("process_vm_readv")
                want -= k
                if want:  # partial copy (a page fault in the middle): go on from there
                    d, s = advance(d, k), advance(s, k)

    def copy(self, dst: np.ndarray, src: np.ndarray, cancel: threading.Event | None = None) -> int:
        """Copy ``src``'s bytes into ``dst``'s pieces (same totals)."""
        dst, src = align(dst, src)
        if not len(dst):
            return 0
        total = nbytes(dst)
        threads = min(self.threads, max(1, total // self.parallel_min_bytes))
        if threads == 1:
            self._copy_rows(dst, src, cancel)
            return total
        if len(dst) == 1:  # one big piece: cut it for the threads
            dst, src = cut(dst, threads), cut(src, threads)
        # Split by bytes, not rows, so the threads finish together; the
        # calling thread copies the first part itself.
        ends = np.cumsum(dst[:, 1])
        marks = np.searchsorted(ends, np.linspace(0, int(ends[-1]), threads + 1)[1:-1])
        bounds = [(lo, hi) for lo, hi in itertools.pairwise([0, *sorted({int(m) for m in marks}), len(dst)]) if hi > lo]
        self._threads.run([functools.partial(self._copy_rows, dst[lo:hi], src[lo:hi], cancel) for lo, hi in bounds])
        return total

    def close(self) -> None:
        if self._owned:
            self._threads.close()


