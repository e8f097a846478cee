"""What workers and peer daemons ask of a daemon, and what it answers, as
plain frozen data.

gRPC's messages become these once, at the edge (``kvd/convert.py``, called
by the service, the peer client and the worker client), so nothing past it
knows protobuf, and nothing changes a request after it arrived: resolving
params made before P published gives new params (``TransferParams.resolved``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvd.core.aggregate import WorkerFinished
from kvd.core.engine_meta import EngineMeta
from kvd.core.reads import Offer
from kvd.core.spec import GroupSpec, ModelInfo, WorkerId


@dataclass(frozen=True)
class Blocks:
    """One KV cache group's block ids, holding the prompt from ``first_token`` on."""

    ids: tuple[int, ...]
    first_token: int = 0


@dataclass(frozen=True)
class Resolution:
    """What the owner answers a Resolve: the publication behind params made before it."""

    generation: int
    epoch: str
    ranks_published: int
    block_ids: tuple[Blocks, ...]
    num_tokens: int
    stream: bool
    lease_seconds: float = 0.0  # P's lease of it (0: unknown, an older owner)


@dataclass(frozen=True)
class TransferParams:
    """vLLM's ``kv_transfer_params`` for kvd: where a request's KV is, and the
    capability that reads it."""

    remote_engine_id: str
    remote_address: str
    request_id: str
    capability: bytes
    block_ids: tuple[Blocks, ...]
    num_tokens: int
    remote_epoch: str = ""  # empty: not yet known (resolved)
    generation: int = 0  # 0: not yet known (resolved)
    remote_tp_size: int = 0
    remote_pp_size: int = 0
    lease_seconds: float = 0.0
    stream: bool = False

    def offer(self) -> Offer:
        return Offer(self.request_id, self.generation, self.capability, tuple(b.ids for b in self.block_ids), self.num_tokens,
                     tuple(b.first_token for b in self.block_ids), self.stream)

    def resolved(self, r: Resolution) -> TransferParams:
        """These params with what the owner resolved: the generation, the epoch
        where unknown, and the blocks where none were known (params made before
        P allocated); a streaming publication is read as a stream, and
        renewed by the lease P holds it to."""
        blocks, tokens = self.block_ids, self.num_tokens
        if not any(b.ids for b in blocks):
            blocks, tokens = r.block_ids, min(tokens, r.num_tokens)  # all decode wants, if prefill holds it
        return dataclasses.replace(self, generation=r.generation, remote_epoch=self.remote_epoch or r.epoch,
                                   block_ids=blocks, num_tokens=tokens, stream=self.stream or r.stream,
                                   lease_seconds=r.lease_seconds or self.lease_seconds)


@dataclass(frozen=True)
class PullOrder:
    """A decode worker's Pull: read ``params`` into its own blocks."""

    worker: WorkerId
    request_id: str
    params: TransferParams
    local: tuple[Blocks, ...]
    priority: str = ""  # the wire's order (core/qos.py): class, tenant, deadline in ms from now (0: none)
    tenant: str = ""
    deadline_ms: float = 0.0


@dataclass(frozen=True)
class PublishOrder:
    """A Publish (one worker, ``worker`` set) or a PublishEngine (every rank of ``engine_id``)."""

    request_id: str
    block_ids: tuple[Blocks, ...]
    num_tokens: int
    capability: bytes = b""  # generated if empty
    reader_engine_id: str = ""  # only this engine may read
    lease_seconds: float = 0.0  # 0: the daemon's default
    stream: bool = False
    worker: WorkerId | None = None
    engine_id: str = ""
    verify: str = ""  # this request's verification (off, sampled, full); empty: the daemon's


@dataclass(frozen=True)
class LeaseRef:
    request_id: str
    generation: int
    capability: bytes


@dataclass(frozen=True)
class PeerAbort:
    """A reader will not read (or finish reading) a publication."""

    engine_id: str  # the owner
    request_id: str
    generation: int
    capability: bytes
    reason: str


@dataclass(frozen=True)
class ShmSource:
    name: str


@dataclass(frozen=True)
class CudaIpcSource:
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class Region:
    """Memory a worker registers, by shm name or CUDA IPC handle (``source`` None: neither given)."""

    region_id: str
    size_bytes: int
    source: ShmSource | CudaIpcSource | None


@dataclass(frozen=True)
class Registering:
    """A worker's Register: its memory and groups (tensor views over that memory)."""

    worker: WorkerId
    model: ModelInfo
    regions: tuple[Region, ...]
    groups: tuple[GroupSpec, ...]
    worker_token: bytes = b""
    alive_shm: str = ""  # a shared-memory file its process holds locked while it lives ("": none)


@dataclass(frozen=True)
class Registered:
    generation: int
    nbytes: int
    daemon_epoch: str
    worker_token: bytes


@dataclass(frozen=True)
class RankMemory:
    """One of a same-host owner's ranks: memory a reader may map, and which registration it is."""

    tp_rank: int
    pp_rank: int
    regions: tuple[Region, ...]
    groups: tuple[GroupSpec, ...]  # with tensor views
    registration: int


@dataclass(frozen=True)
class Introduction:
    """One side of a handshake: the engine, and (same host only) its memory."""

    meta: EngineMeta
    fingerprint: str
    memory: tuple[RankMemory, ...] = ()
    data_token: bytes = b""  # the callee's: what the reader's HELLO brings
    memory_refused: str = ""  # why memory that came with it is not usable (the reader then reads over TCP)


@dataclass(frozen=True)
class FinishedReport:
    """A rank's outcomes, reported by its daemon to the engine's aggregator daemon."""

    engine_id: str
    rank: tuple[int, int]  # (tp, pp): the aggregator merges by request, not by who
    finished: WorkerFinished
    sender_epoch: str
    seq: int
