"""The data plane's requests as plain data: what a reader asks an owner for.

``DataRead`` is one read of one owner rank's blocks for one request, cut
into ``DataSegment``s that are served in order, each as one DATA frame whose
payload is the restricted view in the owner's physical order. ``Offer`` is
what the owner offered for a request (vLLM's ``kv_transfer_params`` as the
core sees them). The protobuf forms of these live in ``kvd.convert``; the
core never sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BATCH_BLOCKS = 8192  # block ids in one batched segment (bounds the READ message)


@dataclass(frozen=True)
class DataSegment:
    group_id: int
    layers: tuple[int, ...]  # owner-rank-local layer positions within the group
    block_start: int = 0
    block_count: int = 0
    token_start: int = 0
    token_count: int = 0
    kv_start: int = 0  # K/V planes [kv_start, kv_start + kv_count); count 0 = all
    kv_count: int = 0
    # Scattered blocks batched into one segment: when set, these blocks (in
    # this order) replace [block_start, block_start + block_count).
    block_ids: tuple[int, ...] = ()
    # A state group's heads, in the owner rank's numbering, when they are not
    # the read's (state parts split by their own heads); count 0 = the read's.
    head_start: int = 0
    head_count: int = 0


MAX_STRIPES = 64  # stripes of one read; an owner refuses more (they would only hold the publication to its lease)


@dataclass(frozen=True)
class DataRead:
    owner_engine_id: str
    request_id: str
    generation: int
    capability: bytes
    tp_rank: int  # the owner rank read
    pp_rank: int
    head_start: int
    head_count: int
    segments: tuple[DataSegment, ...] = ()
    reader_tp_rank: int = 0
    reader_pp_rank: int = 0
    # transport nixl: the version of the owner's agent metadata the reader
    # holds (0: none); the owner sends fresh metadata when it changed.
    nixl_metadata_version: int = 0
    # A big read may be striped over several connections: this is stripe
    # ``stripe`` of ``stripes`` (0 of 0 or 1 when not striped). The owner ends
    # the rank's publication once every stripe of every expected reader is ACKed.
    stripe: int = 0
    stripes: int = 0
    # A streaming publication (layer-wise): segments come layer-major, each
    # served once its layers are saved, so the reader waits between them.
    stream: bool = False
    # A same-host read: the owner rank's registration whose memory the reader
    # mapped. The owner refuses a stale one (the worker registered again).
    mapped_registration: int = 0
    # The pull's place on a contended wire (core/qos.py), for the owner's
    # sends: class, tenant, and its deadline as ms left when the READ left.
    priority: str = ""
    tenant: str = ""
    deadline_ms: float = 0.0

    def heads_of(self, seg: DataSegment) -> tuple[int, int]:
        """The owner-rank heads ``seg`` reads: its own, else the read's."""
        return (seg.head_start, seg.head_count) if seg.head_count else (self.head_start, self.head_count)

    @property
    def rank(self) -> tuple[int, int]:
        return (self.tp_rank, self.pp_rank)

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        """The same read in every attempt of a pull: (remote rank, head slice, stripe)."""
        return (self.tp_rank, self.pp_rank, self.head_start, self.stripe, self.stripes)


@dataclass(frozen=True)
class Offer:
    """What the owner published for a request, as a reader plans from it."""

    request_id: str
    generation: int
    capability: bytes
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group
    num_tokens: int
    # per group: the token its first block starts at (empty: all 0)
    first_tokens: tuple[int, ...] = ()
    stream: bool = False  # published before computed: read layer-major as layers are saved

    def first_token(self, group: int) -> int:
        return self.first_tokens[group] if group < len(self.first_tokens) else 0
