"""One pull as data: which remote ranks, which segments, where each lands.

``plan_pull`` joins topology (which ranks and heads), plan (which extents) and
relayout (which views) into ``RankRead``s: a ``DataRead`` message for the
remote owner, and for every segment a ``SegmentSink`` that knows its byte
size and how to land those bytes in local memory. ``serve_segment`` is the
owner's side: the bytes of one segment, zero-copy where the registered memory
already holds them in wire order.

No sockets here; transport/ moves the bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvd.errors import Incompatible, InvalidArgument
from kvd.plan import Extents, plan_extents
from kvd.proto import kvd_pb2 as pb
from kvd.relayout import (
    GroupTensors,
    move_dtype,
    physical,
    select,
    to_units,
    wire_canonical,
    wire_shape,
)
from kvd.spec import EngineMeta, GroupSpec, KVCacheSpec
from kvd.topology import EngineShape, ReadTarget, block_ratio, layers_by_stage, read_targets
from kvd.transport import iovec

# A segment is the unit of pipelining: big enough that per-frame cost vanishes
# (~20 us a frame against ~1 ms for 4 MiB at 4 GB/s), small enough that
# relayout of one overlaps receipt of the next.
DEFAULT_SEGMENT_BYTES = 4 << 20

# Hands out a gather buffer of n bytes, on the device whose memory is being
# gathered where it can (``kvd.transport.base.Staging``).
GatherStaging = Callable[[int, torch.device], torch.Tensor]


def engine_shape(meta: EngineMeta) -> EngineShape:
    use_mla = any(g.spec.use_mla for r in meta.ranks for g in r.groups)
    stages = layers_by_stage([(r.pp_rank, [idx for g in r.groups for idx in g.layer_indices]) for r in meta.ranks])
    return EngineShape(meta.tp_size, meta.pp_size, meta.model.total_num_kv_heads, use_mla, stages)


def check_group_pairing(local: GroupSpec, remote: GroupSpec) -> int:
    """Refuse group pairs whose bytes cannot be converted; returns the block ratio."""
    ls, rs = local.spec, remote.spec
    gid = local.group_id
    if ls.dtype != rs.dtype:
        raise Incompatible(f"group[{gid}].dtype", ls.dtype, rs.dtype, "kvd does not convert dtypes")
    if ls.use_mla != rs.use_mla:
        raise Incompatible(f"group[{gid}].use_mla", ls.use_mla, rs.use_mla)
    if ls.opaque != rs.opaque:
        raise Incompatible(f"group[{gid}].layout", list(ls.layout), list(rs.layout), "an opaque span converts only to an opaque span")
    ratio = block_ratio(rs.block_size, ls.block_size, opaque=ls.opaque)
    if ls.opaque and ls.span_size != rs.span_size:
        raise Incompatible(f"group[{gid}].span_size", ls.span_size, rs.span_size)
    if not ls.opaque and ls.head_size != rs.head_size:
        raise Incompatible(f"group[{gid}].head_size", ls.head_size, rs.head_size)
    return ratio


@dataclass
class SegmentSink:
    """Where one DATA frame's bytes go on the reading side."""

    nbytes: int
    remote_spec: KVCacheSpec
    wire_dims: tuple[int, int, int, int, int]  # layers, blocks, tokens, heads, kv planes
    local: GroupTensors
    local_positions: tuple[int, ...]
    local_block: tuple[int, int]
    local_token: tuple[int, int]
    local_head: tuple[int, int]
    kv: tuple[int, int]  # K/V planes carried: (start, count)
    n: int
    u: int
    local_block_ids: np.ndarray  # the local blocks this segment writes (for invalid_block_ids)
    local_index: torch.Tensor | None = None  # batched scattered blocks: where each wire block lands

    def _targets(self) -> list[tuple[torch.Tensor, slice, slice]]:
        """(restricted local view, wire layer slice, wire kv slice) per part and layer run."""
        kv0, kvn = self.kv
        out = []
        for p, part_kv in enumerate(self.local.kv_of_part):
            if part_kv is None:  # the part holds the kv dim: take our planes of it
                local_kv: tuple[int, int] | None = (kv0, kvn) if self.local.spec.num_kv > 1 else None
                wire_kv = slice(None)
            elif kv0 <= part_kv < kv0 + kvn:  # a K-only or V-only tensor
                local_kv, wire_kv = None, slice(part_kv - kv0, part_kv - kv0 + 1)
            else:
                continue
            for i, c, view in self.local.layer_runs(p, self.local_positions):
                block = (0, view.shape[2]) if self.local_index is not None else self.local_block
                dst = select(view, block, self.local_token, self.local_head, local_kv)
                out.append((dst, slice(i, i + c), wire_kv))
        return out

    def direct(self) -> torch.Tensor | None:
        """The local memory itself, when the wire bytes already have its layout
        and it is contiguous: then bytes are received straight into place."""
        rs, ls = self.remote_spec, self.local.spec
        if rs.layout != ls.layout or rs.parts_per_layer != ls.parts_per_layer or self.u != 1 or self.local_index is not None:
            return None
        targets = self._targets()
        if len(targets) != 1:
            return None
        dst = physical(targets[0][0], rs)
        shape, _ = wire_shape(rs, *self.wire_dims)
        if dst.numel() * rs.itemsize != self.nbytes or not dst.is_contiguous():
            return None
        if tuple(dst.shape) != (shape[0], *shape[2:]) or shape[1] != 1:
            return None
        return dst

    def batched_pieces(self) -> tuple[np.ndarray, int] | None:
        """Where a batched segment's wire pieces land, when local memory has the
        owner's layout and block size: equal dense pieces in wire order (layer,
        part, outer dims, block), so they are written in place."""
        rs, ls = self.remote_spec, self.local.spec
        if self.local_index is None or rs.layout != ls.layout or rs.parts_per_layer != ls.parts_per_layer or self.u != 1:
            return None
        block_dim = 1 + ls.layout.index("block")  # in (layer, *physical)

        def build() -> PieceTemplate | None:
            runs = []
            for dst, layers, kv in self._targets():
                if dst.device.type != "cpu":
                    return None
                runs.append((layers.start or 0, layers.stop - (layers.start or 0), (kv.start or 0) if ls.parts_per_layer == 2 else 0, physical(dst, ls)))
            return _template(runs, block_dim, self.wire_dims[0], self.kv[1] if ls.parts_per_layer == 2 else 1)

        # _targets() depends on these and on the group the cache lives on.
        key = ("sink", self.local_positions, self.local_token, self.local_head, self.kv, self.wire_dims[0])
        template = _cached_template(self.local, key, build)
        if template is None:
            return None
        return template.addresses(self.local_index.cpu().numpy()), template.piece

    def iov(self) -> np.ndarray | None:
        """Where this segment's wire bytes land, as an iovec array of host
        memory (one row when it lands as-is, one per block piece for batched
        blocks), or None when they need staging and a relayout."""
        d = self.direct()
        if d is not None:
            return _tensor_iov(d)
        found = self.batched_pieces()
        return None if found is None else _pieces_iov(*found)

    @property
    def device(self) -> torch.device:
        return self.local.device

    def land(self, payload: torch.Tensor) -> None:
        """Relayout ``payload`` (uint8, this segment's bytes) into local memory.

        On a GPU the payload goes up in one copy and the relayout runs there,
        on the caller's current stream; it has finished when this returns,
        because the caller then reports the blocks landed."""
        device = self.device
        if payload.device != device:
            # Not non_blocking into host memory: the relayout below reads it at once.
            payload = payload.to(device, non_blocking=device.type == "cuda")
        src = wire_canonical(payload.view(move_dtype(self.remote_spec.dtype)), self.remote_spec, *self.wire_dims)
        for dst, layers, kv in self._targets():
            if self.local_index is not None:
                idx = self.local_index if self.local_index.device == dst.device else self.local_index.to(dst.device, non_blocking=True)
                dst[:, :, idx] = src[layers, kv]  # one scatter for every block
            else:
                to_units(dst, self.n, self.u).copy_(to_units(src[layers, kv], self.n, self.u))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


@dataclass
class RankRead:
    target: ReadTarget
    read: pb.DataRead
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
        read = pb.DataRead()
        read.CopyFrom(rr.read)
        del read.segments[:]
        read.segments.extend(rr.read.segments[lo:hi])
        read.stripe, read.stripes = i, len(bounds) - 1
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
    params: pb.TransferParams,
    local_block_ids: Sequence[Sequence[int]],
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    zero_copy_min_bytes: int = 0,
) -> list[RankRead]:
    """Every read one local rank makes for one request."""
    if len(local_block_ids) != len(local_group_specs):
        raise InvalidArgument("local_block_ids", f"<{len(local_block_ids)} groups>", f"must give one list per KV cache group ({len(local_group_specs)})")
    if len(params.block_ids) != len(local_group_specs):
        raise Incompatible("num_groups", len(local_group_specs), len(params.block_ids), "transfer params carry block ids per remote group")
    targets = read_targets(engine_shape(local_meta), engine_shape(remote), local_tp_rank, local_pp_rank)
    reads: list[RankRead] = []
    for target in targets:
        rank = remote.rank(target.remote_tp_rank, target.remote_pp_rank)
        if rank is None:
            raise Incompatible("remote rank", f"tp{target.remote_tp_rank}/pp{target.remote_pp_rank}", "not registered", "the remote engine has not registered that rank yet")
        read = pb.DataRead(
            owner_engine_id=remote.engine_id, request_id=params.request_id, generation=params.generation,
            capability=params.capability, tp_rank=target.remote_tp_rank, pp_rank=target.remote_pp_rank,
            head_start=target.remote_head_start, head_count=target.head_count,
        )
        rr = RankRead(target, read)
        wanted = set(target.layers)
        for gi, (lspec, ltensors) in enumerate(zip(local_group_specs, local_groups, strict=True)):
            rgroup = next((g for g in rank.groups if g.group_id == lspec.group_id), None)
            if rgroup is None:
                raise Incompatible(f"group[{lspec.group_id}]", "present", "absent")
            check_group_pairing(lspec, rgroup)
            layers = [idx for idx in lspec.layer_indices if idx in wanted and idx in rgroup.layer_indices]
            if not layers:
                continue
            remote_ids = list(params.block_ids[gi].ids)
            _plan_group(rr, lspec, ltensors, rgroup, layers, params.num_tokens, remote_ids, local_block_ids[gi], target,
                        segment_bytes, zero_copy_min_bytes or segment_bytes)
        if rr.sinks:
            reads.append(rr)
    return reads


# By default a contiguous extent gets segments of its own only when it fills
# one (``zero_copy_min_bytes`` = ``segment_bytes``); smaller extents are
# batched, many blocks to a segment, since a frame costs tens of microseconds
# of Python on each side. Batched segments still move in place: their pieces
# go to the kernel as one iovec list (see ``owner_iov`` and ``SegmentSink.iov``).


def _plan_group(
    rr: RankRead,
    lgroup: GroupSpec,
    ltensors: GroupTensors,
    rgroup: GroupSpec,
    layers: list[int],
    num_tokens: int,
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
    target: ReadTarget,
    segment_bytes: int,
    zero_copy_min_bytes: int,
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
    ext: Extents = plan_extents(remote_ids, rspec.block_size, list(local_ids), lspec.block_size, num_tokens, max_units=fine_max_units)
    coarse_layers = max(1, min(len(layers), segment_bytes // max(1, unit_plane_bytes * num_kv)))
    r_pos = {idx: i for i, idx in enumerate(rgroup.layer_indices)}
    l_pos = {idx: i for i, idx in enumerate(lgroup.layer_indices)}
    kvs_per_fine = num_kv // planes
    units_per_extent = ext.n * ext.u
    fine_mask = units_per_extent * unit_plane_bytes * kvs_per_fine >= zero_copy_min_bytes
    same_blocks = rspec.block_size == lspec.block_size
    if same_blocks and (~fine_mask).any():
        # Small scattered extents: batch their blocks into few segments, moved
        # with one gather on the owner and one scatter here (numpy, no loop per block).
        _plan_batched(rr, rgroup, ltensors, layers, ext, ~fine_mask, r_pos, l_pos, target, unit_plane_bytes * num_kv, segment_bytes)
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
            rr.read.segments.add(
                group_id=rgroup.group_id, layers=[r_pos[i] for i in chunk_layers],
                block_start=rb, block_count=rc, token_start=rt, token_count=rtc,
                kv_start=kv[0], kv_count=kv[1],
            )
            wire_dims = (len(chunk_layers), rc, rtc, heads, kv[1])
            shape, _ = wire_shape(rspec, *wire_dims)
            rr.sinks.append(
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


MAX_BATCH_BLOCKS = 8192  # block ids in one batched segment (bounds the READ message)


def _plan_batched(
    rr: RankRead,
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
) -> None:
    rspec = rgroup.spec
    lens = (ext.n * ext.u)[mask]
    r_starts, l_starts = ext.remote_block[mask], ext.local_block[mask]
    total = int(lens.sum())
    run = np.repeat(np.arange(lens.shape[0]), lens)
    within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    r_ids, l_ids = r_starts[run] + within, l_starts[run] + within
    layer_chunk = max(1, min(len(layers), segment_bytes // max(1, block_layer_bytes)))
    per_batch = int(min(MAX_BATCH_BLOCKS, max(1, segment_bytes // (block_layer_bytes * layer_chunk))))
    tokens = 1 if rspec.opaque else rspec.block_size
    heads = target.head_count
    for b0 in range(0, total, per_batch):
        rb, lb = r_ids[b0 : b0 + per_batch], l_ids[b0 : b0 + per_batch]
        local_index = torch.from_numpy(lb.astype(np.int64))
        for i in range(0, len(layers), layer_chunk):
            chunk = layers[i : i + layer_chunk]
            rr.read.segments.add(group_id=rgroup.group_id, layers=[r_pos[x] for x in chunk], block_start=0,
                                 block_count=len(rb), token_start=0, token_count=tokens, block_ids=rb.tolist())
            wire_dims = (len(chunk), len(rb), tokens, heads, 0)
            shape, _ = wire_shape(rspec, *wire_dims)
            rr.sinks.append(SegmentSink(
                nbytes=math.prod(shape) * rspec.itemsize, remote_spec=rspec, wire_dims=wire_dims, local=ltensors,
                local_positions=tuple(l_pos[x] for x in chunk), local_block=(0, len(lb)), local_token=(0, tokens),
                local_head=(target.local_head_start, heads), kv=(0, rspec.num_kv), n=len(lb), u=1,
                local_block_ids=lb, local_index=local_index,
            ))


def _kv_range(spec: KVCacheSpec, seg: pb.DataSegment) -> tuple[int, int]:
    return (seg.kv_start, seg.kv_count) if seg.kv_count else (0, spec.num_kv)


def _owner_parts(spec: KVCacheSpec, seg: pb.DataSegment) -> tuple[int, tuple[int, int] | None, list[int]]:
    """A segment's K/V planes on the owner: (planes carried, the kv slice of a
    joined K/V tensor or None, the registered parts to read)."""
    kv0, kvn = _kv_range(spec, seg)
    joined_kv = (kv0, kvn) if spec.parts_per_layer == 1 and spec.num_kv > 1 else None
    parts = [0] if spec.parts_per_layer == 1 else list(range(kv0, kv0 + kvn))
    return kvn, joined_kv, parts


def segment_view(group: GroupTensors, seg: pb.DataSegment, head_start: int, head_count: int) -> torch.Tensor | None:
    """The segment's bytes as a zero-copy view of the owner's memory (flat
    uint8), or None when they are not one contiguous run there."""
    if seg.block_ids:
        return None
    _, joined_kv, parts = _owner_parts(group.spec, seg)
    if len(parts) != 1:
        return None
    runs = list(group.layer_runs(parts[0], tuple(seg.layers)))
    if len(runs) != 1:
        return None
    v = physical(select(runs[0][2], (seg.block_start, seg.block_count), (seg.token_start, seg.token_count), (head_start, head_count), joined_kv),
                 group.spec)
    return v.reshape(-1).view(torch.uint8) if v.is_contiguous() else None


def owner_iov(group: GroupTensors, seg: pb.DataSegment, head_start: int, head_count: int) -> np.ndarray | None:
    """The owner's host memory behind a segment, in wire order, as an iovec
    array (one row for a contiguous run, one per block piece for batched
    blocks); None when it must be gathered (or lives on a GPU)."""
    if group.device.type != "cpu":
        return None
    view = segment_view(group, seg, head_start, head_count)
    if view is not None:
        return _tensor_iov(view)
    found = batched_pieces(group, seg, head_start, head_count)
    return None if found is None else _pieces_iov(*found)


def _tensor_iov(t: torch.Tensor) -> np.ndarray | None:
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return iovec.make([t.data_ptr()], [t.numel() * t.element_size()])


def _pieces_iov(addrs: np.ndarray, piece: int) -> np.ndarray | None:
    if piece <= 0:
        return None
    return iovec.coalesce(iovec.make(addrs, piece))


def segment_nbytes(spec: KVCacheSpec, seg: pb.DataSegment, heads: int) -> int:
    shape, _ = wire_shape(spec, len(seg.layers), seg.block_count, seg.token_count, heads, _kv_range(spec, seg)[1])
    return math.prod(shape) * spec.itemsize


def serve_segment(
    group: GroupTensors, seg: pb.DataSegment, head_start: int, head_count: int, staging: GatherStaging
) -> torch.Tensor:
    """The owner's bytes for one segment, as a flat uint8 tensor.

    Zero-copy (a view of registered memory) when the restricted view is
    contiguous in the owner's physical order; else gathered into ``staging``.
    """
    spec = group.spec
    positions = tuple(seg.layers)
    block = (seg.block_start, seg.block_count)
    token = (seg.token_start, seg.token_count)
    head = (head_start, head_count)
    kvn, joined_kv, parts = _owner_parts(spec, seg)
    if seg.block_ids:
        return _serve_batched(group, seg, head, joined_kv, parts, staging)
    view = segment_view(group, seg, head_start, head_count)
    if view is not None:
        return view
    shape, _ = wire_shape(spec, len(positions), seg.block_count, seg.token_count, head_count, kvn)
    buf = staging(math.prod(shape) * spec.itemsize, group.device)
    out = buf.view(move_dtype(spec.dtype)).view(shape)
    for j, p in enumerate(parts):
        for i, c, view in group.layer_runs(p, positions):
            out[i : i + c, j].copy_(physical(select(view, block, token, head, joined_kv), spec))
    return buf


def _serve_batched(
    group: GroupTensors, seg: pb.DataSegment, head: tuple[int, int], joined_kv: tuple[int, int] | None,
    parts: list[int], staging: GatherStaging,
) -> torch.Tensor:
    """Gather scattered blocks with one index_select per part and layer run."""
    spec = group.spec
    positions = tuple(seg.layers)
    idx = torch.as_tensor(list(seg.block_ids), dtype=torch.int64)
    shape, _ = wire_shape(spec, len(positions), len(seg.block_ids), seg.token_count, head[1], len(parts) if spec.parts_per_layer == 2 else (joined_kv[1] if joined_kv else 0))
    buf = staging(math.prod(shape) * spec.itemsize, group.device)
    out = buf.view(move_dtype(spec.dtype)).view(shape)
    block_dim = 1 + spec.layout.index("block")  # in (layer, *physical)
    for j, p in enumerate(parts):
        for i, c, view in group.layer_runs(p, positions):
            v = physical(select(view, (0, view.shape[2]), (seg.token_start, seg.token_count), head, joined_kv), spec)
            dst = out[i : i + c, j]
            if dst.is_contiguous() and v.device == dst.device:
                torch.index_select(v, block_dim, idx.to(v.device), out=dst)
            else:
                dst.copy_(v.index_select(block_dim, idx.to(v.device)))
    return buf


@dataclass(frozen=True)
class PieceTemplate:
    """Where a batched segment's pieces lie, before its block ids are known:
    piece (layer l, part p, outer index o, block b) starts at
    ``base[l, p, o] + ids[b] * stride[l, p]`` and is ``piece`` bytes long.

    It depends only on the segment's layers and token/head/kv ranges, which
    every segment of a request (and of the next one) shares, so it is built
    once per group and shape; turning block ids into addresses is then one
    numpy broadcast."""

    base: np.ndarray  # uint64 (layers, parts, outer)
    stride: np.ndarray  # uint64 (layers, parts)
    piece: int

    def addresses(self, ids: np.ndarray) -> np.ndarray:
        """Every piece's address in wire order (layer, part, outer dims, block)."""
        step = ids.astype(np.uint64)[None, None, :] * self.stride[:, :, None]  # (L, P, B)
        return (self.base[..., None] + step[:, :, None, :]).reshape(-1)


def _run_template(v: torch.Tensor, block_dim: int) -> tuple[np.ndarray, int, int] | None:
    """For one view in (layer, *physical) order: the address of block 0 at
    each (layer, outer index), in C order, the block dim's stride and the piece
    length, all in bytes; None when a piece (one block, for fixed outer
    indices) is not dense in memory."""
    shape, stride, item = tuple(v.shape), v.stride(), v.element_size()
    expect = 1
    for size, st in zip(reversed(shape[block_dim + 1 :]), reversed(stride[block_dim + 1 :]), strict=True):
        if size != 1 and st != expect:
            return None
        expect *= size
    outer = np.indices(shape[:block_dim], dtype=np.int64).reshape(block_dim, -1)
    off = (outer * np.asarray(stride[:block_dim], dtype=np.int64)[:, None]).sum(0)
    return np.uint64(v.data_ptr()) + (off * item).astype(np.uint64), stride[block_dim] * item, expect * item


def _template(runs: Sequence[tuple[int, int, int, torch.Tensor]], block_dim: int, layers: int, parts: int) -> PieceTemplate | None:
    """A template from (first layer, layer count, part, view) runs; None
    unless every (layer, part) is covered with equal dense pieces."""
    base: np.ndarray | None = None
    stride = np.zeros((layers, parts), dtype=np.uint64)
    filled = np.zeros((layers, parts), dtype=bool)
    piece = 0
    for first, count, part, v in runs:
        found = _run_template(v, block_dim)  # every layer of the run at once
        if found is None or (piece and found[2] != piece):
            return None
        addrs, step, piece = found
        if base is None:
            base = np.zeros((layers, parts, addrs.size // count), dtype=np.uint64)
        if addrs.size != count * base.shape[2]:
            return None
        base[first:first + count, part] = addrs.reshape(count, -1)
        stride[first:first + count, part] = step
        filled[first:first + count, part] = True
    if base is None or not filled.all():
        return None
    return PieceTemplate(base, stride, piece)


_UNBUILT = object()


def _cached_template(group: GroupTensors, key: tuple[object, ...], build: Callable[[], PieceTemplate | None]) -> PieceTemplate | None:
    # Several connection threads share a group: read the cache once, and
    # return what was built, not a second lookup another thread may clear.
    cache = group.templates
    found = cache.get(key, _UNBUILT)
    if found is _UNBUILT:
        if len(cache) >= 1024:  # shapes are few; this only bounds a pathological reader
            cache.clear()
        found = cache[key] = build()
    return found  # type: ignore[return-value]


def owner_template(group: GroupTensors, seg: pb.DataSegment, head_start: int, head_count: int) -> PieceTemplate | None:
    """The owner's piece template for a batched segment's shape (cached on the group)."""
    spec = group.spec
    positions = tuple(seg.layers)
    _, joined_kv, parts = _owner_parts(spec, seg)
    block_dim = 1 + spec.layout.index("block")  # in (layer, *physical)

    def build() -> PieceTemplate | None:
        runs = [(i, c, j, physical(select(view, (0, view.shape[2]), (seg.token_start, seg.token_count), (head_start, head_count), joined_kv), spec))
                for j, p in enumerate(parts) for i, c, view in group.layer_runs(p, positions)]
        return _template(runs, block_dim, len(positions), len(parts))

    key = ("owner", positions, seg.token_start, seg.token_count, head_start, head_count, seg.kv_start, seg.kv_count)
    return _cached_template(group, key, build)


def batched_pieces(group: GroupTensors, seg: pb.DataSegment, head_start: int, head_count: int) -> tuple[np.ndarray, int] | None:
    """The owner's memory behind a batched segment, as equal pieces in wire
    order (layer, part, outer dims, block), or None when it must be gathered."""
    if not seg.block_ids:
        return None
    template = owner_template(group, seg, head_start, head_count)
    if template is None:
        return None
    return template.addresses(np.asarray(seg.block_ids, dtype=np.int64)), template.piece


def validate_segment(group: GroupTensors, seg: pb.DataSegment, head_start: int, head_count: int) -> None:
    """Bounds of one requested segment against the owner's registration."""
    spec = group.spec
    n_layers = len(group.layer_indices)
    if not seg.layers or any(p >= n_layers for p in seg.layers):
        raise InvalidArgument("segment.layers", list(seg.layers)[:8], f"must be non-empty positions in [0, {n_layers})")
    tokens = 1 if spec.opaque else spec.block_size
    if seg.token_count <= 0 or seg.token_start + seg.token_count > tokens:
        raise InvalidArgument("segment.token_start", seg.token_start, f"with count {seg.token_count} is outside [0, {tokens})")
    if head_count <= 0 or head_start + head_count > spec.num_kv_heads:
        raise InvalidArgument("read.head_start", head_start, f"with count {head_count} is outside [0, {spec.num_kv_heads})")
    if len(seg.block_ids) > MAX_BATCH_BLOCKS:
        raise InvalidArgument("segment.block_ids", f"<{len(seg.block_ids)} ids>", f"exceeds {MAX_BATCH_BLOCKS} per segment")
    if seg.kv_count and seg.kv_start + seg.kv_count > spec.num_kv:
        raise InvalidArgument("segment.kv_start", seg.kv_start, f"with count {seg.kv_count} is outside [0, {spec.num_kv})")


def copy_blocks(
    src: Sequence[GroupTensors], src_ids: Sequence[Sequence[int]], dst: Sequence[GroupTensors], dst_ids: Sequence[Sequence[int]], num_tokens: int
) -> int:
    """Copy a request's blocks between two ranks of one engine holding the same
    heads (a replica fan-out): per group, one gather and one scatter per part
    and layer run, all blocks at once. Returns bytes copied."""
    moved = 0
    for s_group, s_ids, d_group, d_ids in zip(src, src_ids, dst, dst_ids, strict=True):
        if s_group.spec != d_group.spec:
            raise Incompatible("replica spec", d_group.spec, s_group.spec, "replicas of one engine must share a spec")
        n = len(s_ids) if s_group.spec.opaque else -(-num_tokens // s_group.spec.block_size)
        s_idx = torch.as_tensor(list(s_ids)[:n], dtype=torch.int64)
        d_idx = torch.as_tensor(list(d_ids)[:n], dtype=torch.int64)
        positions = tuple(range(len(s_group.layer_indices)))
        for p in range(len(s_group.parts)):
            s_runs = [v for _, _, v in s_group.layer_runs(p, positions)]
            d_runs = [v for _, _, v in d_group.layer_runs(p, positions)]
            if [v.shape[0] for v in s_runs] != [v.shape[0] for v in d_runs]:
                s_runs = [v[j : j + 1] for v in s_runs for j in range(v.shape[0])]
                d_runs = [v[j : j + 1] for v in d_runs for j in range(v.shape[0])]
            for sv, dv in zip(s_runs, d_runs, strict=True):
                block = sv.index_select(2, s_idx)
                dv.index_copy_(2, d_idx, block)
                moved += block.numel() * block.element_size()
    return moved
