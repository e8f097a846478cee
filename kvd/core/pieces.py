"""The owner's side of a segment: where its bytes lie, and how to serve them.

``serve_segment`` gives one segment's bytes, zero-copy where registered
memory already holds them in wire order, else gathered into staging.
``owner_iov`` and ``batched_pieces`` give them as lists of memory pieces, so
a transport can send them in place; ``PieceTemplate`` turns a batch's block
ids into piece addresses with one numpy broadcast, and the reader's
``SegmentSink`` uses the same templates to receive in place.
``validate_segment`` bounds a requested segment against the registration;
``copy_blocks`` copies a request between two replicas of one engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvd.core import iov as iovec
from kvd.core.errors import Incompatible, InvalidArgument
from kvd.core.reads import MAX_BATCH_BLOCKS, DataRead, DataSegment
from kvd.core.relayout import (
    GroupTensors,
    gather_blocks,
    index_on,
    move_dtype,
    physical,
    select,
    widen,
    wire_shape,
)
from kvd.core.spec import KVCacheSpec

# Hands out a gather buffer of n bytes, on the device whose memory is being
# gathered where it can (``kvd.transport.base.Staging``).
GatherStaging = Callable[[int, torch.device], torch.Tensor]


def _kv_range(spec: KVCacheSpec, seg: DataSegment) -> tuple[int, int]:
    return (seg.kv_start, seg.kv_count) if seg.kv_count else (0, spec.num_kv)


def _owner_parts(spec: KVCacheSpec, seg: DataSegment) -> tuple[int, tuple[int, int] | None, list[int]]:
    """A segment's K/V planes on the owner: (planes carried, the kv slice of a
    joined K/V tensor or None, the registered parts to read)."""
    kv0, kvn = _kv_range(spec, seg)
    joined_kv = (kv0, kvn) if spec.parts_per_layer == 1 and spec.num_kv > 1 else None
    parts = [0] if spec.parts_per_layer == 1 else list(range(kv0, kv0 + kvn))
    return kvn, joined_kv, parts


def segment_view(group: GroupTensors, seg: DataSegment, head_start: int, head_count: int) -> torch.Tensor | None:
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


def owner_iov(group: GroupTensors, seg: DataSegment, head_start: int, head_count: int) -> np.ndarray | None:
    """The owner's host memory behind a segment, in wire order, as an iovec
    array (one row for a contiguous run, one per block piece for batched
    blocks); None when it must be gathered (or lives on a GPU)."""
    if group.device.type != "cpu":
        return None
    view = segment_view(group, seg, head_start, head_count)
    if view is not None:
        return tensor_iov(view)
    found = batched_pieces(group, seg, head_start, head_count)
    return None if found is None else pieces_iov(*found)


def owner_pieces(group: GroupTensors, seg: DataSegment, head_start: int, head_count: int) -> tuple[np.ndarray, int] | None:
    """The owner's memory behind a segment, on any device, in wire order, as
    equal pieces (addresses, piece bytes): one piece for a contiguous run,
    one per block piece for batched blocks; None when it must be gathered."""
    view = segment_view(group, seg, head_start, head_count)
    if view is not None:
        return np.asarray([view.data_ptr()], dtype=np.uint64), view.numel()
    return batched_pieces(group, seg, head_start, head_count)


def tensor_iov(t: torch.Tensor) -> np.ndarray | None:
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return iovec.make([t.data_ptr()], [t.numel() * t.element_size()])


def pieces_iov(addrs: np.ndarray, piece: int) -> np.ndarray | None:
    if piece <= 0:
        return None
    return iovec.coalesce(iovec.make(addrs, piece))


def segment_nbytes(spec: KVCacheSpec, seg: DataSegment, heads: int) -> int:
    shape, _ = wire_shape(spec, len(seg.layers), seg.block_count, seg.token_count, heads, _kv_range(spec, seg)[1])
    return math.prod(shape) * spec.itemsize


def serve_segment(
    group: GroupTensors, seg: DataSegment, head_start: int, head_count: int, staging: GatherStaging
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
            dst, src = widen(out[i : i + c, j], physical(select(view, block, token, head, joined_kv), spec))
            dst.copy_(src)
    return buf


def _serve_batched(
    group: GroupTensors, seg: DataSegment, head: tuple[int, int], joined_kv: tuple[int, int] | None,
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
    idx = index_on(idx, group.device)
    for j, p in enumerate(parts):
        for i, c, view in group.layer_runs(p, positions):
            v = physical(select(view, (0, view.shape[2]), (seg.token_start, seg.token_count), head, joined_kv), spec)
            gather_blocks(v, block_dim, index_on(idx, v.device), out=out[i : i + c, j])
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


def template_of(runs: Sequence[tuple[int, int, int, torch.Tensor]], block_dim: int, layers: int, parts: int) -> PieceTemplate | None:
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


def owner_template(group: GroupTensors, seg: DataSegment, head_start: int, head_count: int) -> PieceTemplate | None:
    """The owner's piece template for a batched segment's shape (cached on the group)."""
    spec = group.spec
    positions = tuple(seg.layers)
    _, joined_kv, parts = _owner_parts(spec, seg)
    block_dim = 1 + spec.layout.index("block")  # in (layer, *physical)

    def build() -> PieceTemplate | None:
        runs = [(i, c, j, physical(select(view, (0, view.shape[2]), (seg.token_start, seg.token_count), (head_start, head_count), joined_kv), spec))
                for j, p in enumerate(parts) for i, c, view in group.layer_runs(p, positions)]
        return template_of(runs, block_dim, len(positions), len(parts))

    key = ("owner", positions, seg.token_start, seg.token_count, head_start, head_count, seg.kv_start, seg.kv_count)
    return group.cached(key, build)


def batched_pieces(group: GroupTensors, seg: DataSegment, head_start: int, head_count: int) -> tuple[np.ndarray, int] | None:
    """The owner's memory behind a batched segment, as equal pieces in wire
    order (layer, part, outer dims, block), or None when it must be gathered."""
    if not seg.block_ids:
        return None
    template = owner_template(group, seg, head_start, head_count)
    if template is None:
        return None
    return template.addresses(np.asarray(seg.block_ids, dtype=np.int64)), template.piece


def validate_segment(group: GroupTensors, seg: DataSegment, head_start: int, head_count: int) -> None:
    """Bounds of one requested segment against the owner's registration."""
    spec = group.spec
    n_layers = len(group.layer_indices)
    if not seg.layers or max(seg.layers) >= n_layers:
        raise InvalidArgument("segment.layers", list(seg.layers)[:8], f"must be non-empty positions in [0, {n_layers})")
    if len(set(seg.layers)) != len(seg.layers):
        # Each is served in full: a list repeating them (a READ frame holds 500k) multiplied one read's bytes without bound.
        raise InvalidArgument("segment.layers", f"<{len(seg.layers)} positions, {len(set(seg.layers))} distinct>", "must not repeat a layer")
    tokens = 1 if spec.opaque else spec.block_size
    if seg.token_count <= 0 or seg.token_start + seg.token_count > tokens:
        raise InvalidArgument("segment.token_start", seg.token_start, f"with count {seg.token_count} is outside [0, {tokens})")
    if head_count <= 0 or head_start + head_count > spec.num_kv_heads:
        field = "segment.head_start" if seg.head_count else "read.head_start"
        raise InvalidArgument(field, head_start, f"with count {head_count} is outside [0, {spec.num_kv_heads})")
    if len(seg.block_ids) > MAX_BATCH_BLOCKS:
        raise InvalidArgument("segment.block_ids", f"<{len(seg.block_ids)} ids>", f"exceeds {MAX_BATCH_BLOCKS} per segment")
    if seg.kv_count and seg.kv_start + seg.kv_count > spec.num_kv:
        raise InvalidArgument("segment.kv_start", seg.kv_start, f"with count {seg.kv_count} is outside [0, {spec.num_kv})")


def asked_nbytes(tensors: Sequence[GroupTensors], read: DataRead) -> int:
    """The bytes ``read``'s segments ask for (each already ``validate_segment``'d)."""
    total = 0
    sizes: dict[tuple[int, ...], int] = {}  # a big read's thousand segments come in a few shapes
    for seg in read.segments:
        key = (seg.group_id, len(seg.layers), len(seg.block_ids) or seg.block_count, seg.token_count, read.heads_of(seg)[1], seg.kv_count)
        size = sizes.get(key)
        if size is None:
            spec = tensors[seg.group_id].spec
            size = sizes[key] = math.prod(wire_shape(spec, *key[1:5], _kv_range(spec, seg)[1])[0]) * spec.itemsize
        total += size
    return total


def held_nbytes(tensors: Sequence[GroupTensors], block_ids: Sequence[Sequence[int] | np.ndarray]) -> int:
    """The bytes of a rank's published blocks, per group: every layer, head and K/V plane of each."""
    total = 0
    for group, ids in zip(tensors, block_ids, strict=False):
        spec = group.spec
        shape, _ = wire_shape(spec, len(group.layer_indices), len(ids), 1 if spec.opaque else spec.block_size, spec.num_kv_heads, spec.num_kv)
        total += math.prod(shape) * spec.itemsize
    return total


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
                block = gather_blocks(sv, 2, s_idx)
                dv.index_copy_(2, d_idx, block)
                moved += block.numel() * block.element_size()
    return moved
