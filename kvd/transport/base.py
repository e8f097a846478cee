"""What the daemon needs from a data-plane transport, and the one interface
a way of moving bytes plugs in by.

Every read goes over a data connection (``tcp_client``, ``tcp_server``): the
reader's READ, the owner's END, the reader's ACK. So authorisation, leases,
pins and the end of a publication are the same however the bytes cross. The
bytes themselves cross by a *byte mover*: DATA frames on that connection
(``FramesIn``/``FramesOut``), a copy from the owner's memory mapped on this
host (``samehost``), or a NIXL READ (``nixl``). A mover has two halves: the
reader's ``ReadMover`` and the owner's ``ServeMover``. The READ names the
mover (``Read.via``); the owner answers with the one it has by that name.
Planning, relayout, leases and metrics stay in the daemon; the owner's
decisions come through ``ReadServer`` and ``OpenRead``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kvd.core.reads import DataRead
from kvd.core.session import Hello, Read
from kvd.core.sinks import SegmentSink
from kvd.transport.framing import FrameSocket, Gate

CPU = torch.device("cpu")


class Staging:
    """Gather buffers, one per device, that grow to the largest segment and
    are then reused."""

    def __init__(self, *, pinned: bool = False) -> None:
        self.pinned = pinned
        self._bufs: dict[torch.device, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())

    def __call__(self, nbytes: int, device: torch.device = CPU) -> torch.Tensor:
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < nbytes:
            # Pinned (page-locked) host memory lets device copies run at full speed.
            pin = self.pinned and device.type == "cpu" and torch.cuda.is_available()
            buf = self._bufs[device] = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        return buf[:nbytes]

    def shrink(self, keep_bytes: int) -> None:
        """Let go of buffers over ``keep_bytes`` (their work done): one per
        thread and source, kept at a big read's size, would hold GPU memory
        an engine needs; freed, the allocator reuses it for the next read."""
        self._bufs = {d: b for d, b in self._bufs.items() if b.numel() <= keep_bytes}


class OpenRead(Protocol):
    """An authorised read on the owning side."""

    # Set while a reader that copies our memory itself (same host, NIXL)
    # holds the rank pinned: until ``close``.
    pin: object | None

    def segment(self, index: int, staging: Staging) -> torch.Tensor: ...

    def acknowledged(self) -> None:
        """The reader's ACK came: every byte landed (implies ``close``)."""
        ...

    def close(self) -> None:
        """The read is over without an ACK (refused midway, connection gone)."""
        ...

    def check_alive(self) -> None:
        """Raise a KvdError if the read may no longer be served (abort, expiry)."""
        ...

    def wait_saved(self, index: int | None = None) -> None:
        """Block until segment ``index`` (None: all) may be served: a
        streaming publication's layers are saved as prefill computes them."""
        ...

    def saved(self, index: int | None = None) -> bool:
        """Whether ``wait_saved(index)`` would return at once."""
        ...

    def count_sent(self, nbytes: int, blocks: int, transport: str) -> None:
        """Metrics for bytes that left without ``segment`` (in place)."""
        ...

    def served(self, seconds: float) -> None:
        """Metrics: the read's END left ``seconds`` after its READ came in."""
        ...

    def segment_device(self, index: int) -> torch.device:
        """Where the segment's memory lies: host memory, or a GPU."""
        ...

    def segment_nbytes(self, index: int) -> int: ...

    def segment_blocks(self, index: int) -> int: ...

    def segment_iov(self, index: int) -> np.ndarray | None:
        """The segment's registered host memory as an iovec array, in wire order."""
        ...

    def segment_view(self, index: int) -> torch.Tensor | None:
        """The segment as a zero-copy view of registered memory, if it is one."""
        ...

    def segment_pieces(self, index: int) -> tuple[np.ndarray, int] | None:
        """A batched segment's bytes as equal pieces of registered memory, in wire order."""
        ...


class ReadServer(Protocol):
    """The owner's decisions. ``check_hello`` runs on the daemon's event
    loop; ``open_read`` may be called from any thread."""

    def check_hello(self, hello: Hello) -> None: ...

    def open_read(self, hello: Hello, read: DataRead, *, local: bool = False, reader_copies: bool = False) -> OpenRead: ...


class ReadMover(Protocol):
    """The reader's half of a byte mover."""

    name: str  # what the READ asks for: ``Read.via``

    def request(self, read: DataRead) -> Read:
        """The READ that opens ``read``, flagged for this mover."""
        ...

    def land(self, fs: FrameSocket, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
             cancel: threading.Event, gate: Gate | None = None) -> int:
        """In the read's thread, once the READ left: land every segment
        (``landed[i]`` set as each does, never after ``cancel``) and take the
        owner's END (its ERROR raised). Returns bytes moved. With ``gate``
        (``--qos on``), each chunk moves inside ``gate(its bytes)``."""
        ...

    def scratch(self) -> list[int]:
        """The sizes of the buffers it keeps between reads (``Admin.Status`` counts them)."""
        ...

    def close(self) -> None:
        """Let go of what ``scratch`` holds (the connection is dropped)."""
        ...


class ServeMover(Protocol):
    """The owner's half of a byte mover: one a data connection."""

    name: str

    def serve(self, fs: FrameSocket, opened: OpenRead, read: DataRead) -> int:
        """Answer the authorised ``read`` up to its END (which the connection
        sends): DATA frames, one DESCS frame, or nothing where the reader copies.
        Returns the bytes the read moves; a KvdError refuses it midway."""
        ...
