"""NIXL as a kvd data-plane backend (``transport: nixl``).

kvd keeps everything but the bulk bytes: the TCP data connection still
carries HELLO, the capability-checked READ, END and the ACK that releases the
lease, so authorisation, leases, planning, relayout and metrics are the same
as on the TCP path. What changes is how a read's segments cross:

* the owner authorises the read, exposes every segment as one memory
  descriptor (a zero-copy view into a registered region, or a slice of a
  registered per-connection arena when the segment must be gathered), and
  answers a single DESCS frame instead of DATA frames;
* the reader posts one NIXL READ for all of them at once (one descriptor per
  segment: the plan already merged block runs), straight into its own
  registered memory when the segment lands as-is, else into its arena, from
  which each segment is relaid out;
* the owner keeps the exposed memory untouched until the reader's ACK.

NIXL (``pip install 'kvd[nixl]'``) picks UCX's transports: shared memory or
CMA on one host, TCP or RDMA across hosts. Its traffic is not encrypted, so
``transport: nixl`` is refused with ``auth: mtls``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvd.core import errors
from kvd.core.reads import DataRead
from kvd.core.relayout import CopyRunner, run_copies
from kvd.core.session import Descriptors, End, Read
from kvd.core.sinks import SegmentSink
from kvd.transport.base import Gate
from kvd.transport.framing import FrameSocket

# NIXL's Python logger prints INFO on stdout; keep the daemon's output its own.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def available() -> str:
    """Empty if NIXL is installed here, else why not. Looks without importing:
    NIXL's native libraries clash with some others loaded in one process
    (grpc_tools' protoc), so only processes that use it load it."""
    import importlib.util

    if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed; pip install 'kvd[nixl]'"
    return ""


def _api() -> Any:
    try:
        from nixl_cu12 import _api  # the wheel that runs on CPU-only machines too
    except ImportError:
        from nixl import _api  # type: ignore[no-redef]
    return _api


class Arena:
    """Registered scratch memory that grows to the largest read and is reused."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._reg: Any = None

    def reserve(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.release()
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
            self._reg = self.agent.register(self.buf.data_ptr(), nbytes)
        return self.buf[:nbytes]

    def release(self) -> None:
        if self._reg is not None:
            self.agent.deregister(self._reg)
            self._reg = None
        self.buf = torch.empty(0, dtype=torch.uint8)


_agent_lock = threading.Lock()


def _make_agent(api: Any, name: str, progress_delay_us: int) -> Any:
    """A UCX agent whose progress thread waits up to ``progress_delay_us``
    for a UCX event before it looks anyway. NIXL 1.5's Python API sets 0 and
    offers no setting, and then the thread spins: an idle daemon burnt a
    whole core (4.98 CPU s in 5 s, measured). So its call that builds the
    native agent is wrapped for this one construction."""
    native = api.nixlBind.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = progress_delay_us
        return native(agent_name, config)

    with _agent_lock:
        api.nixlBind.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        finally:
            api.nixlBind.nixlAgent = native


class NixlAgent:
    """One NIXL agent per daemon: registered regions, peers' metadata, READs."""

    def __init__(self, name: str, progress_delay_us: int) -> None:
        api = _api()
        self.name = name
        self._agent = _make_agent(api, self.name, progress_delay_us)
        self._lock = threading.Lock()  # registration and peer tables; transfers run unlocked
        self._regions: list[tuple[int, int]] = []  # (base, size) of registered memory
        # Bumped on every (de)registration: peers hold a copy of our metadata,
        # which lists registered memory, and must reload it when this moves.
        self.version = 1
        self._remotes: set[str] = set()  # peer agents whose metadata is loaded

    # ---------------------------------------------------------------- memory

    def register(self, ptr: int, nbytes: int) -> Any:
        with self._lock:
            reg = self._agent.register_memory([(ptr, nbytes, 0, "")], "DRAM")
            self._regions.append((ptr, nbytes))
            self.version += 1
            return (reg, ptr, nbytes)

    def deregister(self, handle: Any) -> None:
        reg, ptr, nbytes = handle
        with self._lock:
            self._agent.deregister_memory(reg)
            self._regions.remove((ptr, nbytes))
            self.version += 1

    def covers_range(self, lo: int, hi: int) -> bool:
        """Whether bytes [lo, hi) lie inside one registered region."""
        with self._lock:
            return any(base <= lo and hi <= base + size for base, size in self._regions)

    def covers(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (contiguous, CPU) lies inside registered memory."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return False
        return self.covers_range(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())

    def metadata(self) -> tuple[bytes, int]:
        with self._lock:
            return bytes(self._agent.get_agent_metadata()), self.version

    def add_remote(self, metadata: bytes) -> str:
        """Load (or refresh: NIXL replaces an agent's entry) a peer's metadata."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            return name

    # ---------------------------------------------------------------- transfer

    def read(self, remote: str, local_descs: np.ndarray, remote_descs: np.ndarray, *, cancel: threading.Event, stall_s: float) -> None:
        """One READ of every descriptor pair ((addr, len, dev) rows), to completion."""
        local = self._agent.get_xfer_descs(local_descs, "DRAM")
        far = self._agent.get_xfer_descs(remote_descs, "DRAM")
        handle = self._agent.initialize_xfer("READ", local, far, remote)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + stall_s
            while state == "PROC":
                if cancel.is_set():
                    raise ConnectionAbortedError("read abandoned")
                if time.monotonic() > deadline:
                    raise errors.DeadlineExceeded(f"NIXL READ from {remote} made no progress for {stall_s}s")
                time.sleep(0)  # yield the GIL; UCX progresses in its own thread
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise errors.Unavailable(f"NIXL READ from {remote} ended {state}")
        finally:
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        with self._lock:
            for name in list(self._remotes):
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
            self._remotes.clear()


def descs(ptrs: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    out = np.zeros((len(ptrs), 3), dtype=np.uint64)
    out[:, 0] = ptrs
    out[:, 1] = lengths
    return out


def expose(agent: NixlAgent, opened: Any, count: int, arena: Arena, max_bytes: int) -> tuple[Descriptors, int]:
    """Owner side: one descriptor per segment of an authorised read.

    A segment that is already a contiguous view of registered memory is
    exposed in place; the rest are gathered into the arena, which the caller
    keeps untouched until the reader's ACK.
    """
    views = [opened.segment_view(i) for i in range(count)]  # one planning pass; gathers come later
    views = [v if v is not None and agent.covers(v) else None for v in views]
    sizes = [v.numel() if v is not None else opened.segment_nbytes(i) for i, v in enumerate(views)]
    # Scattered blocks: one descriptor per block piece, in place, when the pieces are dense.
    pieces: list[tuple[np.ndarray, int] | None] = [None] * count
    for i, v in enumerate(views):
        if v is None:
            found = opened.segment_pieces(i)
            if found is not None and len(found[0]) * found[1] == sizes[i] and agent.covers_range(int(found[0].min()), int(found[0].max()) + found[1]):
                pieces[i] = found
    need = sum(n for n, v, pc in zip(sizes, views, pieces, strict=True) if v is None and pc is None)
    if need > max_bytes:
        raise errors.ResourceExhausted(f"a NIXL read needs {need} bytes of gather staging, over the {max_bytes}-byte cap; read fewer blocks at once")
    scratch = arena.reserve(need) if need else torch.empty(0, dtype=torch.uint8)
    addrs: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    counts: list[int] = []
    offset, in_place, in_place_blocks = 0, 0, 0
    for i, view in enumerate(views):
        found = pieces[i]
        if found is not None:
            addrs.append(found[0])
            lengths.append(np.full(len(found[0]), found[1], dtype=np.uint64))
            counts.append(len(found[0]))
            in_place += sizes[i]
            in_place_blocks += opened.segment_blocks(i)
            continue
        counts.append(1)
        lengths.append(np.asarray([sizes[i]], dtype=np.uint64))
        if view is None:
            opened.check_alive()
            target = scratch[offset:offset + sizes[i]]
            payload = opened.segment(i, _Fixed(target), "nixl")
            if payload.data_ptr() != target.data_ptr():
                target.copy_(payload.reshape(-1).view(torch.uint8))
            addrs.append(np.asarray([target.data_ptr()], dtype=np.uint64))
            offset += sizes[i]
        else:
            addrs.append(np.asarray([view.data_ptr()], dtype=np.uint64))
            in_place += sizes[i]
            in_place_blocks += opened.segment_blocks(i)
    opened.check_alive()
    opened.count_sent(in_place, in_place_blocks, "nixl")
    every = np.asarray(counts if any(c != 1 for c in counts) else [], dtype=np.int64)
    return Descriptors(agent.name, np.concatenate(addrs).astype(np.uint64), np.concatenate(lengths).astype(np.uint64), every), sum(sizes)


class _Fixed:
    """A Staging that hands out one preallocated slice."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def __call__(self, nbytes: int, device: torch.device | None = None) -> torch.Tensor:
        return self.buf[:nbytes]  # host memory NIXL registered, wherever the source lies


def land(agent: NixlAgent, msg: Descriptors, sinks: Sequence[SegmentSink], landed: list[bool], arena: Arena,
         cancel: threading.Event, stall_s: float, on_relayout: Any, run: CopyRunner = run_copies) -> int:
    """Reader side: READ every segment, straight into place where it lands
    as-is, else into the arena and relaid out from there."""
    counts = msg.counts if len(msg.counts) else np.ones(len(sinks), dtype=np.int64)
    lengths = msg.lengths
    if len(counts) != len(sinks) or len(msg.addrs) != len(lengths) or int(counts.sum()) != len(lengths) or (counts < 1).any():
        raise errors.InvalidArgument("descriptors", f"<{len(counts)} segments, {len(lengths)} descriptors>",
                                     f"must describe the read's {len(sinks)} segments")
    ends = np.cumsum(counts)
    starts = ends - counts
    seg_bytes = np.add.reduceat(lengths, starts) if len(lengths) else np.zeros(0, dtype=np.uint64)
    for i, sink in enumerate(sinks):
        if int(seg_bytes[i]) != sink.nbytes:
            raise errors.InvalidArgument(f"descriptors[{i}]", int(seg_bytes[i]), f"must cover the segment's {sink.nbytes} bytes")
    directs = []
    need = 0
    for sink in sinks:
        d = sink.direct()
        d = d.reshape(-1).view(torch.uint8) if d is not None and agent.covers(d) else None
        directs.append(d)
        need += 0 if d is not None else sink.nbytes
    # Scattered blocks whose owner sent one descriptor per piece land in place
    # too, when our pieces pair with the owner's one for one.
    in_place: dict[int, np.ndarray] = {}
    for i, (d, sink) in enumerate(zip(directs, sinks, strict=True)):
        if d is None and counts[i] > 1:
            found = sink.batched_pieces()
            seg_lengths = lengths[starts[i]:ends[i]]
            if (found is not None and len(found[0]) == counts[i] and bool((seg_lengths == found[1]).all())
                    and agent.covers_range(int(found[0].min()), int(found[0].max()) + found[1])):
                in_place[i] = found[0]
                need -= sink.nbytes
    scratch = arena.reserve(need) if need else None
    bases, staged = np.zeros(len(sinks), dtype=np.uint64), []
    offset = 0
    for i, (d, sink) in enumerate(zip(directs, sinks, strict=True)):
        if d is not None:
            bases[i] = d.data_ptr()
        elif i in in_place:
            pass
        else:
            assert scratch is not None
            buf = scratch[offset:offset + sink.nbytes]
            bases[i] = buf.data_ptr()
            staged.append((i, buf))
            offset += sink.nbytes
    # Each segment's descriptors land back to back from its base, in wire order.
    within = np.cumsum(lengths) - lengths - np.repeat(np.cumsum(seg_bytes) - seg_bytes, counts)
    local = np.repeat(bases, counts) + within
    for i, addrs in in_place.items():
        local[starts[i]:ends[i]] = addrs
    agent.read(msg.agent_name, descs(local, lengths), descs(msg.addrs, lengths), cancel=cancel, stall_s=stall_s)
    t0 = time.perf_counter()
    for i, buf in staged:
        if cancel.is_set():
            raise ConnectionAbortedError("read abandoned")
        sinks[i].land(buf, run)
    if staged:
        on_relayout(time.perf_counter() - t0)
    for i in range(len(sinks)):
        landed[i] = True
    return int(lengths.sum())


class NixlIn:
    """The reader's half of the NIXL mover, one a data connection: the owner
    answers where each segment lies (DESCS), one NIXL READ moves them all."""

    name = "nixl"

    def __init__(self, agent: NixlAgent, address: str, peers: dict[str, tuple[str, int]], stall_s: float,
                 on_relayout: Callable[[float], None], run: CopyRunner) -> None:
        self.agent, self.address, self.stall_s, self.on_relayout, self.run = agent, address, stall_s, on_relayout, run
        self.peers = peers  # shared by the client's connections: data address -> (owner's agent, metadata version loaded)
        self.arena: Arena | None = None  # landing scratch, registered on first use

    def request(self, read: DataRead) -> Read:
        known = self.peers.get(self.address)
        return Read(dataclasses.replace(read, nixl_metadata_version=known[1] if known else 0), nixl=True)

    def land(self, fs: FrameSocket, read: DataRead, sinks: Sequence[SegmentSink], landed: list[bool],
             cancel: threading.Event, gate: Gate | None = None) -> int:
        # --qos on: NIXL's READs are posted whole, so its reads are not ordered by the gate.
        msg = fs.expect(Descriptors)
        if msg.agent_metadata:
            name = self.agent.add_remote(msg.agent_metadata)
            if msg.metadata_version >= self.peers.get(self.address, ("", 0))[1]:
                self.peers[self.address] = (name, msg.metadata_version)
        if self.peers.get(self.address, ("", 0))[0] != msg.agent_name:
            raise errors.FailedPrecondition(f"{self.address} answered for NIXL agent {msg.agent_name!r}, whose metadata we do not hold")
        if self.arena is None:
            self.arena = Arena(self.agent)
        moved = land(self.agent, msg, sinks, landed, self.arena, cancel, self.stall_s, self.on_relayout, self.run)
        fs.expect(End)  # the owner sends it right after DESCS
        return int(moved)

    def scratch(self) -> list[int]:
        return [self.arena.buf.numel()] if self.arena is not None and self.arena.buf.numel() else []

    def close(self) -> None:
        if self.arena is not None:
            self.arena.release()


class NixlOut:
    """The owner's half, one a data connection: where each segment lies in
    NIXL-registered memory (in place, or gathered into this connection's
    arena, kept untouched until the reader's ACK), and our agent's metadata
    where the reader's copy is stale."""

    name = "nixl"

    def __init__(self, agent: NixlAgent, arena: Arena, max_bytes: int) -> None:
        self.agent, self.arena, self.max_bytes = agent, arena, max_bytes

    def serve(self, fs: FrameSocket, opened: Any, read: DataRead) -> int:
        opened.wait_saved()  # the reader copies it all at once: every layer first
        msg, total = expose(self.agent, opened, len(read.segments), self.arena, self.max_bytes)
        metadata, version = self.agent.metadata()
        # The metadata only where the reader's copy lacks some registration (or it has none).
        fs.send(dataclasses.replace(msg, metadata_version=version, agent_metadata=metadata if read.nixl_metadata_version != version else b""))
        return total
