"""GPU memory on the data plane: side streams and pinned double buffers.

A CUDA copy or kernel returns before it has run. The engine reads landed KV
from another process, on streams that know nothing of the daemon's, so every
device copy here runs on a stream of the daemon thread's own and is waited
for before its bytes are reported landed or its buffer is reused.

Each thread gets its own stream per device, so the connections' copies run
side by side instead of queueing on the default stream, and they overlap the
network: the reader relays out segment k on the GPU (``SegmentSink.land``, in
a landing thread) while segment k+1 arrives; the owner gathers segment k+1 on
the GPU and copies it down to pinned host memory (``DeviceToHost``) while
segment k is on the wire.

On a machine without CUDA all of this is a no-op: host memory takes the
zero-copy paths in ``kvd.transport.tcp`` instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from kvd.transport.base import Staging

_local = threading.local()


def thread_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own stream on ``device``, made on first use."""
    streams: dict[torch.device, torch.cuda.Stream] = _local.__dict__.setdefault("streams", {})
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def device_copies(device: torch.device) -> Iterator[None]:
    """Run the body's CUDA work on this thread's stream for ``device`` and
    return only once that work has finished. Nothing to do for host memory."""
    if device.type != "cuda":
        yield
        return
    stream = thread_stream(device)
    # Work this process queued earlier on the device (a gather on the
    # default stream) comes first.
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()  # on failure too: the caller reuses the buffers next


class DeviceToHost:
    """Owner side: device segments leave through two pinned host buffers.

    ``start(k)`` queues segment k's gather (on the GPU) and its copy to pinned
    memory on this thread's stream and returns at once; ``take(k)`` waits for
    that copy. The sender starts k+1 before it sends k, so the GPU work and
    the PCIe copy of one segment hide behind the wire time of the other. At
    most two segments are staged, so memory stays bounded by two segments per
    connection however slow the reader is.
    """

    def __init__(self) -> None:
        self._gather = (Staging(), Staging())  # on the device, where gathers run
        self._host = (Staging(pinned=True), Staging(pinned=True))
        self._pending: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def start(self, index: int, device: torch.device, produce: Callable[[Staging], torch.Tensor]) -> None:
        """Queue segment ``index``: ``produce(staging)`` gathers it on ``device``."""
        if index in self._pending:
            return
        if len(self._pending) >= 2:
            raise RuntimeError("DeviceToHost holds two segments already; take one first")
        slot = index % 2
        stream = thread_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            src = produce(self._gather[slot])
            host = self._host[slot](src.numel())
            host.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._pending[index] = (host, done)

    def take(self, index: int) -> torch.Tensor:
        """Segment ``index`` in pinned host memory, once its copy has finished."""
        host, done = self._pending.pop(index)
        done.synchronize()
        return host

    def drain(self) -> None:
        """Wait for whatever is still queued (a send that failed midway), so
        no copy still writes into a buffer that is reused or freed."""
        for _, done in self._pending.values():
            done.synchronize()
        self._pending.clear()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in (*self._gather, *self._host))
