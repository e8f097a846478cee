"""The one driver of a data-plane ``Session``: a blocking socket, plain or TLS.

``FrameSocket`` writes the frames a session makes of events and feeds it
what the socket reads, so the protocol lives in ``kvd.core.session`` and
nowhere here. Bulk bytes bypass the session: a DATA payload is sent from
where it lies (one ``sendmsg`` over its pieces, ``kvd.transport.iovec``) and
received straight into place. TLS wraps the socket; only the syscalls
differ (no ``sendmsg``/``recvmsg`` with TLS), never the protocol code.

Each connection is driven by one thread at a time, on a blocking socket
whose SO_RCVTIMEO/SO_SNDTIMEO bound a stall: Python's own socket timeout
would ``poll()`` before every syscall, and the vectorised iovec calls need a
blocking descriptor anyway.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import numpy as np
import torch

from kvd.core import errors
from kvd.core import iov as iovs
from kvd.core.addresses import split_host_port
from kvd.core.session import HEADER_SIZE, Data, Error, Event, ProtocolError, Session
from kvd.transport import iovec
from kvd.transport.codec import CODEC

E = TypeVar("E")

# Bigger kernel buffers let one recv_into/send return megabytes, so a read
# takes far fewer syscalls (per-call cost is what limited earlier versions).
SOCKET_BUFFER_BYTES = 8 << 20


def always() -> bool:
    return True


def never() -> bool:
    return False


class Gate(Protocol):
    """A read's place on the wire (``wire_gate``, ``--qos on``): it moves
    at most ``chunk_bytes`` at a time, each chunk inside ``gate(its bytes)``;
    ``then``, asked as the chunk ends: whether the read's next chunk follows
    at once; if not (it waits for prefill, or it was the last), the read
    keeps no place on the wire meanwhile."""

    @property
    def chunk_bytes(self) -> int: ...

    def __call__(self, nbytes: int, then: Callable[[], bool] = ...) -> AbstractContextManager[None]: ...


def tune(sock: socket.socket, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """``buffer_bytes``: with --qos on, a chunk's: what a read the order
    paused still has in flight, and competes with the read it let go first."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)


def split_address(address: str) -> tuple[str, int]:
    host, port = split_host_port(address)
    return host or "127.0.0.1", int(port)


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class FrameSocket:
    def __init__(self, sock: socket.socket, *, owner: bool) -> None:
        self.sock = sock
        self.session = Session(CODEC, owner=owner)
        self.tls = isinstance(sock, ssl.SSLSocket)  # no sendmsg/recvmsg, and no MSG_WAITALL
        if not self.tls:
            sock.setblocking(True)  # stalls are bounded by SO_RCVTIMEO/SO_SNDTIMEO instead
        self._header = bytearray(HEADER_SIZE)

    @contextlib.contextmanager
    def stall_bound(self, seconds: float | None) -> Iterator[None]:
        """Every send and receive inside fails after ``seconds`` without
        progress (None: wait for ever, as between reads)."""
        if self.tls:
            self.sock.settimeout(seconds)
        else:
            s = seconds or 0.0  # 0: no timeout
            tv = struct.pack("ll", int(s), int((s % 1) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        yield

    # ------------------------------------------------------------ out

    def send(self, event: Event) -> None:
        self.sock.sendall(self.session.send(event))

    def send_nowait(self, frame: memoryview) -> int:
        """Write as much of ``frame`` as the socket takes without blocking
        (from the event loop); returns the bytes written."""
        if self.tls:
            return 0  # an SSL socket's record state belongs to the thread that drives it
        try:
            return self.sock.send(frame, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def send_data(self, tag: int, payload: np.ndarray | torch.Tensor, gate: Gate | None = None, more: Callable[[], bool] = always) -> int:
        """One DATA frame: its header, then the payload from where it lies
        (an iovec array of host memory, or a tensor). Returns payload bytes.
        With ``gate`` (--qos on), a chunk at a time, each once the wire is
        ours; ``more``, asked as the frame's last chunk ends: whether the
        read's next frame follows at once."""
        if isinstance(payload, np.ndarray):
            n = iovec.nbytes(payload)
            head = self.session.send(Data(tag, n))
            if gate is None:
                iovec.send_all(self.sock, payload, head)
                return n
            parts = iovs.chunks(payload, gate.chunk_bytes)
            for k, part in enumerate(parts):
                with gate(iovs.nbytes(part), then=more if k + 1 == len(parts) else always):
                    iovec.send_all(self.sock, part, head if k == 0 else b"")
            return n
        n = payload.numel() * payload.element_size()
        head_view, body = memoryview(self.session.send(Data(tag, n))), as_bytes(payload)
        if gate is None:
            self._sendmsg_all([head_view, body])
            return n
        self._sendmsg_all([head_view])
        for at in range(0, len(body), gate.chunk_bytes):
            with gate(min(gate.chunk_bytes, len(body) - at), then=more if at + gate.chunk_bytes >= len(body) else always):
                self._sendmsg_all([body[at: at + gate.chunk_bytes]])
        return n

    def send_iov(self, iov: np.ndarray) -> None:
        """Bytes already framed (``data_frames``), in one vectorised send."""
        iovec.send_all(self.sock, iov)

    def data_frames(self, payloads: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """DATA frames 0..n-1 over host memory, as one iovec list (and the
        header buffers it points into, to keep alive until it is sent)."""
        parts: list[bytes | np.ndarray] = []
        for tag, iov in enumerate(payloads):
            parts += [self.session.send(Data(tag, iovec.nbytes(iov))), iov]
        return iovec.chain(parts)

    def _sendmsg_all(self, buffers: list[memoryview]) -> None:
        if self.tls:
            for b in buffers:
                self.sock.sendall(b)
            return
        while buffers:
            sent = self.sock.sendmsg(buffers)
            while buffers and sent >= len(buffers[0]):
                sent -= len(buffers[0])
                buffers.pop(0)
            if buffers and sent:
                buffers[0] = buffers[0][sent:]

    # ------------------------------------------------------------ in

    def next_event(self) -> Event:
        """The next frame as an event. After ``Data`` the caller receives
        its payload (``recv_into`` or ``recv_iov``) before asking again."""
        self.recv_into(memoryview(self._header))
        head = self.session.receive_header(self._header)
        if isinstance(head, Data):
            return head
        body = bytearray(head.length)
        self.recv_into(memoryview(body))
        return self.session.receive_body(bytes(body))

    def expect(self, kind: type[E]) -> E:
        """The peer's one control answer, of ``kind``; its ERROR raised as the error it names."""
        ev = self.next_event()
        if isinstance(ev, Error):
            raise errors.from_code(ev.code, ev.message)
        if not isinstance(ev, kind):
            raise ProtocolError(f"expected {kind.__name__}, got {type(ev).__name__}")
        return ev

    def recv_into(self, view: memoryview) -> None:
        got, flags = 0, 0 if self.tls else socket.MSG_WAITALL
        while got < len(view):
            try:
                k = self.sock.recv_into(view[got:], 0, flags)
            except BlockingIOError as e:  # SO_RCVTIMEO ran out on a blocking socket
                raise TimeoutError("data-plane receive stalled") from e
            if k == 0:
                raise ConnectionResetError("peer closed the connection")
            got += k

    def recv_iov(self, iov: np.ndarray) -> None:
        """Fill every piece of ``iov`` (host memory) straight from the socket."""
        if self.tls:
            raise ProtocolError("scattered receives need a plain socket")
        iovec.recv_all(self.sock, iov)

    def close(self) -> None:
        self.sock.close()
