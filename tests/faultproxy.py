"""A loopback TCP proxy that forwards, then stalls or resets on command."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class FaultProxy:
    """Forwards 127.0.0.1:port -> target. ``stall_after`` / ``reset_after`` set a
    byte budget for the server->client direction; past it the proxy stops
    forwarding (stall) or sends a TCP RST (reset, once). ``flip_at`` corrupts
    one byte of that direction in transit."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.target: tuple[str, int] | None = None
        self.stall_after: int | None = None
        self.reset_after: int | None = None
        self.forwarded = 0
        self.resets = 0
        self.stalled = threading.Event()
        self.refuse = False  # close new connections at once (the target looks down)
        self.flip_at: int | None = None  # flip the low bit of the server->client byte at this offset (once)
        self._release = threading.Event()
        self._closed = False
        self._open: list[socket.socket] = []
        self.live = 0  # client connections open now (a pair whose pipes have not both closed)
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def release(self) -> None:
        """Let a stalled stream go on."""
        self.stall_after = None
        self._release.set()

    def cut(self) -> None:
        """Drop every connection open now (later ones are forwarded, unless ``refuse``)."""
        open_now, self._open = self._open, []
        for s in open_now:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the pipe threads blocked in recv; they close it

    def close(self) -> None:
        self._closed = True
        self._release.set()
        self.sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.refuse:
                client.close()
                continue
            assert self.target is not None
            server = socket.create_connection(self.target)
            self._open += [client, server]
            with self._lock:
                self.live += 1
            pair = [2]  # pipes of this pair still running: the last to end counts it closed
            threading.Thread(target=self._pipe, args=(client, server, False, pair), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True, pair), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, downstream: bool, pair: list[int]) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if downstream:
                    if self.reset_after is not None and self.forwarded + len(data) > self.reset_after:
                        self.reset_after = None
                        self.resets += 1
                        dst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        # The other pipe thread is blocked reading dst: wake it, or
                        # the kernel holds the file open and sends no RST at close.
                        dst.shutdown(socket.SHUT_RD)
                        dst.close()
                        src.close()
                        return
                    if self.stall_after is not None and self.forwarded + len(data) > self.stall_after:
                        self.stalled.set()
                        self._release.wait(timeout=60)
                    if self.flip_at is not None and self.forwarded <= self.flip_at < self.forwarded + len(data):
                        i, self.flip_at = self.flip_at - self.forwarded, None
                        data = data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :]
                    self.forwarded += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # wakes the pair's other pipe, blocked in recv, and passes the close on
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                pair[0] -= 1
                if not pair[0]:
                    self.live -= 1


def prefill_behind_proxy(daemons, *extra: str):  # type: ignore[no-untyped-def]
    """A prefill daemon whose data plane peers reach only through a FaultProxy."""
    proxy = FaultProxy()
    p = daemons.start("prefill", "--data-advertise-address", proxy.address, *extra)
    proxy.target = ("127.0.0.1", int(p.info["data_bind"].rsplit(":", 1)[1]))
    return p, proxy
