"""One pull as data: which remote ranks, which segments, where each lands.

``plan_pull`` joins topology (which ranks and heads), plan (which extents) and
relayout (which views) into ``RankRead``s: a ``DataRead`` for the remote
owner, and for every segment a ``SegmentSink`` (``kvd.core.sinks``) that
knows its byte size and how to land those bytes in local memory. The owner's
side of a segment is ``kvd.core.pieces``.

No sockets here; transport/ moves the bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvd.core.engine_meta import EngineMeta
from kvd.core.errors import Incompatible, InvalidArgument
from kvd.core.groups import FULL
from kvd.core.pairing import check_group_pairing, engine_shape
from kvd.core.plan import Extents, plan_extents
from kvd.core.reads import MAX_BATCH_BLOCKS, DataRead, DataSegment, Offer
from kvd.core.relayout import (
    GroupTensors,
    wire_shape,
)
from kvd.core.sinks import SegmentSink
from kvd.core.spec import GroupSpec
from kvd.core.topology import ReadTarget, read_targets

# A segment is the unit of pipelining: big enough that per-frame cost vanishes
# (~20 us a frame against ~1 ms for 4 MiB at 4 GB/s), small enough that
# relayout of one overlaps receipt of the next.
DEFAULT_SEGMENT_BYTES = 4 << 20
# Where both sides hold the wire's layout nothing is relaid out, so nothing
# needs pipelining and a frame's fixed cost (its Python and wake-ups on both
# sides) is all its size controls. 256 MiB over loopback in 1 MiB / 16 KiB
# units, against 4 MiB frames (benchmarks, same run): CPU per GB 0.57 -> 0.50
# and 0.73 -> 0.56 (medians), 16 KiB units 2.8 -> 3.3 GB/s (best). A read of
# 2 x STRIPE_MIN_BYTES still has a frame for each of its two stripes.
IN_PLACE_SEGMENT_BYTES = 32 << 20

@dataclass
class RankRead:
    """One read of one remote rank, and where each of its segments lands."""

    target: ReadTarget
    read: DataRead
    sinks: list[SegmentSink] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sinks)


# Reads at least this big are striped over several connections (below it the
# extra READ/ACK round trip costs more than a second stream gains).
STRIPE_MIN_BYTES = 32 << 20


def stripe(rr: RankRead, stripes: int) -> list[RankRead]:
    """Cut one rank's read into at most ``stripes`` reads of about equal bytes,
    each a run of whole segments, for as many connections. Each carries
    ``stripe``/``stripes`` so the owner knows how many ACKs end the rank."""
    if stripes <= 1 or len(rr.sinks) <= 1:
        return [rr]
    ends = np.cumsum([s.nbytes for s in rr.sinks])
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, stripes) / stripes, side="left") + 1
    bounds = sorted({0, len(rr.sinks), *(int(c) for c in cuts if 0 < c < len(rr.sinks))})
    out = []
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        read = dataclasses.replace(rr.read, segments=rr.read.segments[lo:hi], stripe=i, stripes=len(bounds) - 1)
        out.append(RankRead(rr.target, read, rr.sinks[lo:hi]))
    return out


def plan_pull(
    *,
    local_meta: EngineMeta,
    local_tp_rank: int,
    local_pp_rank: int,
    local_groups: Sequence[GroupTensors],
    local_group_specs: Sequence[GroupSpec],
    remote: EngineMeta,
    params: Offer,
    local_block_ids: Sequence[Sequence[int]],
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    zero_copy_min_bytes: int = 0,
    local_first_tokens: Sequence[int] = (),
) -> list[RankRead]:
    """Every read one local rank makes for one request.

    Each group moves only the tokens decode needs of it (see ``core.groups``),
    from the later of that and the token its local ids start at. A streaming
    offer (``params.stream``) is planned layer-major: one layer a segment,
    in model layer order, so each can leave as soon as prefill saved it."""
    layer_major = params.stream
    if len(local_block_ids) != len(local_group_specs):
        raise InvalidArgument("local_block_ids", f"<{len(local_block_ids)} groups>", f"must give one list per KV cache group ({len(local_group_specs)})")
    if len(params.block_ids) != len(local_group_specs):
        raise Incompatible("num_groups", len(local_group_specs), len(params.block_ids), "transfer params carry block ids per remote group")
    targets = read_targets(engine_shape(local_meta), engine_shape(remote), local_tp_rank, local_pp_rank)
    # One read per remote rank: a state group's heads differ from attention's,
    # so its segments name their own (a rank's reads are counted by the owner).
    by_rank: dict[tuple[int, int], RankRead] = {}
    for target in targets:
        rank = remote.rank(target.remote_tp_rank, target.remote_pp_rank)
        if rank is None:
            raise Incompatible("remote rank", f"tp{target.remote_tp_rank}/pp{target.remote_pp_rank}", "not registered", "the remote engine has not registered that rank yet")
        segments: list[DataSegment] = []
        sinks: list[SegmentSink] = []
        wanted = set(target.layers)
        for gi, (lspec, ltensors) in enumerate(zip(local_group_specs, local_groups, strict=True)):
            if (lspec.group_id not in target.groups) if target.groups is not None else lspec.spec.state:
                continue  # another head split's group
            rgroup = next((g for g in rank.groups if g.group_id == lspec.group_id), None)
            if rgroup is None:
                raise Incompatible(f"group[{lspec.group_id}]", "present", "absent")
            check_group_pairing(lspec, rgroup)
            layers = [idx for idx in lspec.layer_indices if idx in wanted and idx in rgroup.layer_indices]
            if not layers:
                continue
            remote_ids, local_ids = list(params.block_ids[gi]), list(local_block_ids[gi])
            if lspec.kind.is_state:
                if not local_ids:
                    continue  # decode wants no state of this group
                if not remote_ids:
                    # Landing nothing would leave decode's state as it was: silently wrong.
                    raise Incompatible(f"group[{lspec.group_id}].block_ids", f"<{len(local_ids)} blocks>", "<none>",
                                       "prefill offered no state for this state group")
                # The running state is each side's last block; its rows move whole.
                remote_ids, local_ids = remote_ids[-1:], local_ids[-1:]
                tokens: TokenRange | None = TokenRange(lspec.spec.block_size, 0, 0, 0)
            else:
                local_first = local_first_tokens[gi] if gi < len(local_first_tokens) else 0
                tokens = token_range(lspec, rgroup.spec.block_size, params.num_tokens, params.first_token(gi), local_first)
            if tokens is None:
                continue
            _plan_group(segments, sinks, lspec, ltensors, rgroup, layers, tokens, remote_ids, local_ids, target,
                        segment_bytes, zero_copy_min_bytes or segment_bytes, layer_major)
        if target.groups is not None:
            segments = [dataclasses.replace(x, head_start=target.remote_head_start, head_count=target.head_count) for x in segments]
        if not sinks:
            continue
        key = (target.remote_tp_rank, target.remote_pp_rank)
        rr = by_rank.get(key)
        if rr is None:
            read = DataRead(
                owner_engine_id=remote.engine_id, request_id=params.request_id, generation=params.generation,
                capability=params.capability, tp_rank=target.remote_tp_rank, pp_rank=target.remote_pp_rank,
                head_start=target.remote_head_start, head_count=target.head_count, segments=tuple(segments),
                reader_tp_rank=local_tp_rank, reader_pp_rank=local_pp_rank, stream=layer_major,
            )
            by_rank[key] = RankRead(target, read, sinks)
        else:
            rr.read = dataclasses.replace(rr.read, segments=rr.read.segments + tuple(segments))
            rr.sinks.extend(sinks)
    reads = list(by_rank.values())
    return [_layer_order(rr, remote) for rr in reads] if layer_major else reads


def _layer_order(rr: RankRead, remote: EngineMeta) -> RankRead:
    """The read's segments in model layer order (stable): the order prefill saves them."""
    rank = remote.rank(*rr.read.rank)
    assert rank is not None
    indices = {g.group_id: g.layer_indices for g in rank.groups}
    last = [max(indices[s.group_id][p] for p in s.layers) for s in rr.read.segments]
    order = sorted(range(len(rr.sinks)), key=last.__getitem__)
    read = dataclasses.replace(rr.read, segments=tuple(rr.read.segments[i] for i in order))
    return RankRead(rr.target, read, [rr.sinks[i] for i in order])


@dataclass(frozen=True)
class TokenRange:
    """One group's tokens in one pull: each side's ids start at its
    ``*_first`` token, and ``[start, num_tokens)`` moves."""

    num_tokens: int
    remote_first: int
    local_first: int
    start: int


def needed_from(group: GroupSpec, num_tokens: int, local_first: int) -> int:
    """The first token decode needs of ``group`` and does not hold itself."""
    return max(local_first, group.kind.first_needed_token(num_tokens))


def token_range(local: GroupSpec, remote_block_size: int, num_tokens: int, remote_first: int, local_first: int) -> TokenRange | None:
    """What one group's pull moves: from the first token decode needs, down
    to a unit boundary, and never from before what prefill still holds.

    None when decode needs none of the group's tokens. Prefill must hold
    everything decode needs. And every block decode offers
    of a window group must be written whole: an engine caches its blocks by
    prefix hash, and a later request hitting that prefix would read a part
    left unwritten (so decode offers none before the window, as vLLM's null
    blocks do, and its first block is not part filled).
    """
    gid = local.group_id
    bs = local.spec.block_size
    small = min(remote_block_size, bs)
    needed = needed_from(local, num_tokens, local_first)
    if needed >= num_tokens:
        return None  # decode needs none of this group's tokens (a chunk starts at num_tokens)
    if remote_first > needed:
        raise Incompatible(f"group[{gid}].first_token", needed, remote_first,
                           f"prefill's blocks of this {local.kind} group start after the first token decode needs")
    start = max(needed // small * small, remote_first)
    if local.kind.name != FULL:
        if start % bs:
            raise Incompatible(f"group[{gid}].block_size", bs, remote_block_size,
                               f"decode's block from token {start // bs * bs} would be part filled: "
                               f"prefill kept this {local.kind} group only from token {remote_first}")
        if start - local_first >= bs:
            raise InvalidArgument(f"local_block_ids[{gid}].first_token", local_first,
                                  f"offers blocks before token {start}, where this {local.kind} group's pull starts: they would stay unwritten")
    return TokenRange(num_tokens, remote_first, local_first, start)


def skipped_bytes(group: GroupSpec, num_tokens: int, local_first: int, held: int) -> int:
    """Bytes of ``group`` (this rank's heads, all its layers) that full
    attention would have moved, from the ``held`` tokens decode already has,
    and its kind does not (a window's leading tokens; none for a state part,
    which has no tokens to skip)."""
    if group.kind.is_state:
        return 0
    start = needed_from(group, num_tokens, local_first) // group.spec.block_size * group.spec.block_size
    skipped = max(0, start - held)
    return skipped * group.spec.bytes_per_block_per_layer // group.spec.block_size * len(group.layers)


# By default a contiguous extent gets segments of its own only when it fills
# one (``zero_copy_min_bytes`` = ``segment_bytes``); smaller extents are
# batched, many blocks to a segment, since a frame costs tens of microseconds
# of Python on each side. Batched segments still move in place: their pieces
# go to the kernel as one iovec list (see ``owner_iov`` and ``SegmentSink.iov``).


def _plan_group(
    segments: list[DataSegment],
    sinks: list[SegmentSink],
    lgroup: GroupSpec,
    ltensors: GroupTensors,
    rgroup: GroupSpec,
    layers: list[int],
    tokens: TokenRange,
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
    target: ReadTarget,
    segment_bytes: int,
    zero_copy_min_bytes: int,
    layer_major: bool = False,
) -> None:
    rspec, lspec = rgroup.spec, lgroup.spec
    heads = target.head_count
    if target.remote_head_start + heads > rspec.num_kv_heads:
        raise Incompatible("num_kv_heads", lspec.num_kv_heads, rspec.num_kv_heads, f"remote rank holds too few heads for [{target.remote_head_start}, +{heads})")
    unit = 1 if rspec.opaque else min(rspec.block_size, lspec.block_size)
    num_kv = rspec.num_kv
    # Bytes of one unit (B tokens) of one layer and one K/V plane, for our heads.
    per_block_layer = rspec.bytes_per_block_per_layer * heads // rspec.num_kv_heads
    unit_plane_bytes = max(1, per_block_layer // num_kv // (1 if rspec.opaque else rspec.block_size) * unit)
    # The owner's memory is contiguous per (layer, K/V plane) when kv sits
    # outside the block dim (or K and V are separate tensors).
    kv_outer = rspec.parts_per_layer == 2 or ("kv" in rspec.layout and rspec.layout.index("kv") < rspec.layout.index("block"))
    planes = num_kv if kv_outer else 1
    fine_max_units = max(1, segment_bytes // (unit_plane_bytes * (num_kv // planes)))
    ext: Extents = plan_extents(remote_ids, rspec.block_size, list(local_ids), lspec.block_size, tokens.num_tokens, max_units=fine_max_units,
                                remote_first=tokens.remote_first, local_first=tokens.local_first, start=tokens.start,
                                label=f"[{lgroup.group_id}]")
    coarse_layers = 1 if layer_major else max(1, min(len(layers), segment_bytes // max(1, unit_plane_bytes * num_kv)))
    r_pos = {idx: i for i, idx in enumerate(rgroup.layer_indices)}
    l_pos = {idx: i for i, idx in enumerate(lgroup.layer_indices)}
    kvs_per_fine = num_kv // planes
    units_per_extent = ext.n * ext.u
    fine_mask = units_per_extent * unit_plane_bytes * kvs_per_fine >= zero_copy_min_bytes
    same_blocks = rspec.block_size == lspec.block_size
    if same_blocks and (~fine_mask).any():
        # Small scattered extents: batch their blocks into few segments, moved
        # with one gather on the owner and one scatter here (numpy, no loop per block).
        _plan_batched(segments, sinks, rgroup, ltensors, layers, ext, ~fine_mask, r_pos, l_pos, target, unit_plane_bytes * num_kv, segment_bytes,
                      1 if layer_major else len(layers))
    for e in range(len(ext)):
        if same_blocks and not fine_mask[e]:
            continue
        rb, rc, rt, rtc = ext.side(e, remote=True)
        lb, lc, lt, ltc = ext.side(e, remote=False)
        n, u = int(ext.n[e]), int(ext.u[e])
        if rspec.opaque:
            rt, rtc, lt, ltc = 0, 1, 0, 1  # the span hides tokens; whole blocks only
        if fine_mask[e]:
            pieces = [([layer], (p * kvs_per_fine, kvs_per_fine)) for layer in layers for p in range(planes)]
        else:
            chunk = coarse_layers if n * u * unit_plane_bytes * num_kv * coarse_layers <= segment_bytes else 1
            pieces = [(layers[i : i + chunk], (0, num_kv)) for i in range(0, len(layers), chunk)]
        local_block_ids = np.arange(lb, lb + lc, dtype=np.int64)
        for chunk_layers, kv in pieces:
            segments.append(DataSegment(
                group_id=rgroup.group_id, layers=tuple(r_pos[i] for i in chunk_layers),
                block_start=rb, block_count=rc, token_start=rt, token_count=rtc,
                kv_start=kv[0], kv_count=kv[1],
            ))
            wire_dims = (len(chunk_layers), rc, rtc, heads, kv[1])
            shape, _ = wire_shape(rspec, *wire_dims)
            sinks.append(
                SegmentSink(
                    nbytes=math.prod(shape) * rspec.itemsize,
                    remote_spec=rspec,
                    wire_dims=wire_dims,
                    local=ltensors,
                    local_positions=tuple(l_pos[i] for i in chunk_layers),
                    local_block=(lb, lc),
                    local_token=(lt, ltc),
                    local_head=(target.local_head_start, heads),
                    kv=kv,
                    n=n, u=u,
                    local_block_ids=local_block_ids,
                )
            )


def _plan_batched(
    segments: list[DataSegment],
    sinks: list[SegmentSink],
    rgroup: GroupSpec,
    ltensors: GroupTensors,
    layers: list[int],
    ext: Extents,
    mask: np.ndarray,
    r_pos: dict[int, int],
    l_pos: dict[int, int],
    target: ReadTarget,
    block_layer_bytes: int,
    segment_bytes: int,
    max_layers: int,
) -> None:
    rspec = rgroup.spec
    lens = (ext.n * ext.u)[mask]
    r_starts, l_starts = ext.remote_block[mask], ext.local_block[mask]
    total = int(lens.sum())
    run = np.repeat(np.arange(lens.shape[0]), lens)
    within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    r_ids, l_ids = r_starts[run] + within, l_starts[run] + within
    layer_chunk = max(1, min(len(layers), max_layers, segment_bytes // max(1, block_layer_bytes)))
    per_batch = int(min(MAX_BATCH_BLOCKS, max(1, segment_bytes // (block_layer_bytes * layer_chunk))))
    tokens = 1 if rspec.opaque else rspec.block_size
    heads = target.head_count
    # Per segment only slicing and two records: a 128k-token request has
    # over a thousand segments, and this loop is most of its plan.
    r_list, l_index = r_ids.tolist(), torch.from_numpy(l_ids.astype(np.int64))
    chunks = [(tuple(r_pos[x] for x in c), tuple(l_pos[x] for x in c)) for c in (layers[i : i + layer_chunk] for i in range(0, len(layers), layer_chunk))]
    for b0 in range(0, total, per_batch):
        block_ids, lb, local_index = tuple(r_list[b0 : b0 + per_batch]), l_ids[b0 : b0 + per_batch], l_index[b0 : b0 + per_batch]
        # Local blocks that happen to be one run (a state block always is)
        # are relaid out by a slice copy, not an index scatter: the copies of
        # kvd bench's Mamba2 state row ran 2.4x faster, the row 1.2-1.4x.
        # The index stays: where the bytes land in place as pieces (same
        # layout), it says where, and no copy runs at all.
        local_run = bool((np.diff(lb) == 1).all())  # one block is a run too (no diffs)
        local_block = (int(lb[0]), len(lb)) if local_run else (0, len(lb))
        for r_layers, l_layers in chunks:
            segments.append(DataSegment(group_id=rgroup.group_id, layers=r_layers, block_start=0,
                                        block_count=len(block_ids), token_start=0, token_count=tokens, block_ids=block_ids))
            wire_dims = (len(r_layers), len(block_ids), tokens, heads, 0)
            shape, _ = wire_shape(rspec, *wire_dims)
            sinks.append(SegmentSink(
                nbytes=math.prod(shape) * rspec.itemsize, remote_spec=rspec, wire_dims=wire_dims, local=ltensors,
                local_positions=l_layers, local_block=local_block, local_token=(0, tokens),
                local_head=(target.local_head_start, heads), kv=(0, rspec.num_kv), n=len(lb), u=1,
                local_block_ids=lb, local_index=local_index, local_run=local_run,
            ))
