"""The same-host path: the reader copies straight from the owner's memory.

When both daemons share a host, the handshake hands the reader the owner's
regions and the reader maps them (``LocalSource``). A read still goes to the
owner for authorisation over the data connection; then ``copy_local`` moves
the bytes: where both sides are host memory in wire order, every segment in
one ``process_vm_readv`` pass, piece to piece (``iovec.Copier``); else
gathered from the owner's memory and landed as usual (GPU to GPU: a device
copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvd.core.pieces import owner_iov, owner_pieces, serve_segment
from kvd.core.reads import DataRead
from kvd.core.relayout import CopyRunner, GroupTensors, run_copies
from kvd.core.session import End, Read
from kvd.core.sinks import SegmentSink
from kvd.core.transfer import DEFAULT_SEGMENT_BYTES
from kvd.transport import device_pieces, iovec
from kvd.transport.base import Gate, OpenRead, Staging
from kvd.transport.device import device_copies, thread_stream
from kvd.transport.framing import FrameSocket, never


class LocalSource:
    """The owner rank's memory, mapped by the reader on the same host."""

    def __init__(self, groups: dict[int, GroupTensors], registration: int = 0, check: Callable[[], None] = lambda: None) -> None:
        self.groups = groups
        self.registration = registration  # the owner's, when we mapped it: every read names it
        # Raises where the owner's memory shrank under our mapping: the next
        # copy from it would fault (SIGBUS) and take the daemon down.
        self.check = check
        # Several pulls may copy from this source at once, each in its own
        # thread: each thread gathers into its own staging.
        self._local = threading.local()

    @property
    def staging(self) -> Staging:
        staging: Staging | None = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = Staging()
        return staging


def copy_local(read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool], source: LocalSource,
               cancel: threading.Event | None = None, copier: iovec.Copier | None = None, run: CopyRunner = run_copies) -> int:
    """Same-host segments. Where both sides are in wire order (the owner's
    layout and block size here), every such segment goes in one pass, piece
    to piece, with no staging: on host memory by ``copier``, on a GPU by one
    kernel (``device_pieces``); the rest are gathered from the owner's memory
    and landed as usual."""
    source.check()
    moved = 0
    dsts: list[np.ndarray] = []
    srcs: list[np.ndarray] = []
    in_place: list[int] = []
    device_landed: list[int] = []
    opened: set[torch.device] = set()
    # GPU pieces for device_pieces, by (device, piece bytes): one launch each.
    by_kernel: dict[tuple[torch.device, int], tuple[list[np.ndarray], list[np.ndarray]]] = {}
    with contextlib.ExitStack() as streams:
        for i, (seg, sink) in enumerate(zip(read.segments, sinks, strict=True)):
            if cancel is not None and cancel.is_set():
                raise ConnectionAbortedError("read abandoned")
            group = source.groups[seg.group_id]
            if copier is not None and copier.available:
                dst = sink.iov()
                src = owner_iov(group, seg, *read.heads_of(seg)) if dst is not None else None
                if dst is not None and src is not None and iovec.nbytes(src) == sink.nbytes:
                    dsts.append(dst)
                    srcs.append(src)
                    in_place.append(i)
                    continue
            gpus = {dev for dev in (sink.device, group.device) if dev.type == "cuda"}
            if gpus and device_pieces.available(sink.device, group.device):
                # GPU to GPU in wire order: pieces paired one for one, copied by
                # one kernel for the whole read (below), with no staging.
                found = sink.pieces()
                src_pieces = owner_pieces(group, seg, *read.heads_of(seg)) if found is not None else None
                pairs = device_pieces.pair(found, src_pieces) if found is not None and src_pieces is not None else None
                if pairs is not None:
                    dst_list, src_list = by_kernel.setdefault((sink.device, pairs[2]), ([], []))
                    dst_list.append(pairs[0])
                    src_list.append(pairs[1])
                    device_landed.append(i)
                    continue
            if gpus:
                # GPU to GPU (CUDA IPC): gathered on the owner's device, then
                # one device copy or a relayout on ours. Every device segment
                # of the read is queued on this thread's stream and waited for
                # once, when the stack closes: a wait per segment left the GPU
                # idle between them (64 waits in a 256 MiB read).
                for dev in gpus - opened:
                    opened.add(dev)
                    streams.enter_context(device_copies(dev))
                sink.put(serve_segment(group, seg, *read.heads_of(seg), source.staging), run, wait=False)
                device_landed.append(i)
                continue
            sink.put(serve_segment(group, seg, *read.heads_of(seg), source.staging), run)
            landed[i] = True
            moved += sink.nbytes
        for (device, piece), (dst_list, src_list) in by_kernel.items():
            if device not in opened:
                opened.add(device)
                streams.enter_context(device_copies(device))
            with torch.cuda.stream(thread_stream(device)):
                device_pieces.copy_pairs(np.concatenate(dst_list), np.concatenate(src_list), piece, device)
    for i in device_landed:  # the stack waited for their copies
        landed[i] = True
        moved += sinks[i].nbytes
    if device_landed:  # GPU reads plan big segments: their staging goes back to the allocator
        source.staging.shrink(DEFAULT_SEGMENT_BYTES)
    if in_place:
        assert copier is not None
        moved += copier.copy(np.concatenate(dsts), np.concatenate(srcs), cancel)
        for i in in_place:
            landed[i] = True
    return moved


class SameHostIn:
    """The reader's half of the same-host mover: the owner authorises (END,
    no DATA), then ``copy_local`` copies from its memory mapped here."""

    name = "samehost"

    def __init__(self, source: LocalSource, copier: iovec.Copier, run: CopyRunner, on_relayout: Callable[[float], None]) -> None:
        self.source, self.copier, self.run, self.on_relayout = source, copier, run, on_relayout

    def request(self, read: DataRead) -> Read:
        # The registration we mapped: a worker that registered again since makes the owner refuse it.
        return Read(dataclasses.replace(read, mapped_registration=self.source.registration), local=True)

    def land(self, fs: FrameSocket, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
             cancel: threading.Event, gate: Gate | None = None) -> int:
        # Authorisation first, then the copy: copying while the owner decides
        # would save a round trip, but a refused read would already have
        # written another request's bytes into our memory.
        fs.expect(End)
        t0 = time.perf_counter()
        # One chunk, the whole copy (--qos on): its order among reads, not within one.
        with gate(sum(s.nbytes for s in sinks), then=never) if gate is not None else contextlib.nullcontext():
            moved = copy_local(read, sinks, landed, self.source, cancel, self.copier, self.run)
        self.on_relayout(time.perf_counter() - t0)
        return moved

    def scratch(self) -> list[int]:
        return []  # the source's, per thread

    def close(self) -> None:
        pass


class SameHostOut:
    """The owner's half: nothing crosses; the reader copies once every layer is saved."""

    name = "samehost"

    def serve(self, fs: FrameSocket, opened: OpenRead, read: DataRead) -> int:
        opened.wait_saved()  # the reader copies it all at once: every layer first
        return 0
