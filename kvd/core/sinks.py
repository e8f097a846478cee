"""Where one segment's bytes land on the reading side (``SegmentSink``).

A sink knows the segment's byte size, the local views its bytes go to, and
how to put them there: straight into place when the wire bytes already have
the local layout (``direct``, or ``iov``/``batched_pieces`` for a transport
that receives into memory), else the strided copies of a relayout
(``copies``, ``land``). ``kvd.core.transfer`` plans the sinks; transport/
feeds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvd.core.pieces import PieceTemplate, pieces_iov, template_of, tensor_iov
from kvd.core.relayout import (
    Copy,
    CopyRunner,
    GroupTensors,
    index_on,
    move_dtype,
    physical,
    run_copies,
    select,
    to_units,
    widen,
    wire_canonical,
    wire_shape,
)
from kvd.core.spec import KVCacheSpec


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
    local_index: torch.Tensor | None = None  # batched blocks: where each wire block lands
    # The batched blocks are one run, ``local_block``: a relayout lands them
    # by a slice copy, not an index scatter (2.4x faster on kvd bench's state row).
    local_run: bool = False

    def _targets(self, scatter: bool) -> list[tuple[torch.Tensor, slice, slice, int]]:
        """(restricted local view, wire layer slice, wire kv slice, bytes from
        one local block to the next) per part and layer run; with ``scatter``
        the view spans every block (the copy indexes them, or the pieces say where)."""
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
                block = (0, view.shape[2]) if scatter else self.local_block
                dst = select(view, block, self.local_token, self.local_head, local_kv)
                out.append((dst, slice(i, i + c), wire_kv, view.stride(2) * view.element_size()))
        return out

    def direct(self) -> torch.Tensor | None:
        """The local memory itself, when the wire bytes already have its layout
        and it is contiguous: then bytes are received straight into place."""
        rs, ls = self.remote_spec, self.local.spec
        if rs.layout != ls.layout or rs.parts_per_layer != ls.parts_per_layer or self.u != 1 or self.local_index is not None:
            return None
        targets = self._targets(False)
        if len(targets) != 1:
            return None
        dst = physical(targets[0][0], rs)
        shape, _ = wire_shape(rs, *self.wire_dims)
        if dst.numel() * rs.itemsize != self.nbytes or not dst.is_contiguous():
            return None
        if tuple(dst.shape) != (shape[0], *shape[2:]) or shape[1] != 1:
            return None
        return dst

    def batched_pieces(self, on_device: bool = False) -> tuple[np.ndarray, int] | None:
        """Where a batched segment's wire pieces land, when local memory has the
        owner's layout and block size: equal dense pieces in wire order (layer,
        part, outer dims, block), so they are written in place. Host memory
        only, unless ``on_device`` (the device piece copier's addresses)."""
        rs, ls = self.remote_spec, self.local.spec
        if self.local_index is None or rs.layout != ls.layout or rs.parts_per_layer != ls.parts_per_layer or self.u != 1:
            return None
        if self.device.type != "cpu" and not on_device:
            return None
        block_dim = 1 + ls.layout.index("block")  # in (layer, *physical)

        def build() -> PieceTemplate | None:
            runs = []
            for dst, layers, kv, _ in self._targets(True):
                runs.append((layers.start or 0, layers.stop - (layers.start or 0), (kv.start or 0) if ls.parts_per_layer == 2 else 0, physical(dst, ls)))
            return template_of(runs, block_dim, self.wire_dims[0], self.kv[1] if ls.parts_per_layer == 2 else 1)

        # _targets() depends on these and on the group the cache lives on.
        key = ("sink", self.local_positions, self.local_token, self.local_head, self.kv, self.wire_dims[0])
        template = self.local.cached(key, build)
        if template is None:
            return None
        return template.addresses(self.local_index.cpu().numpy()), template.piece

    def pieces(self) -> tuple[np.ndarray, int] | None:
        """Where this segment's wire bytes land, on any device, as equal
        pieces (addresses, piece bytes): one where they land as-is, one per
        block piece for batched blocks; None when they need a relayout."""
        d = self.direct()
        if d is not None:
            return np.asarray([d.data_ptr()], dtype=np.uint64), self.nbytes
        return self.batched_pieces(on_device=True)

    def iov(self) -> np.ndarray | None:
        """Where this segment's wire bytes land, as an iovec array of host
        memory (one row when it lands as-is, one per block piece for batched
        blocks), or None when they need staging and a relayout."""
        d = self.direct()
        if d is not None:
            return tensor_iov(d)
        found = self.batched_pieces()
        return None if found is None else pieces_iov(*found)

    @property
    def device(self) -> torch.device:
        return self.local.device

    def copies(self, payload: torch.Tensor) -> list[Copy]:
        """The strided copies that relayout ``payload`` (uint8, this
        segment's bytes, on this sink's device) into local memory.

        Segments of one shape differ only in their blocks and their bytes, so
        the copies' strides are worked out once per shape (a ``CopyTemplate``
        cached on the group) and each segment only moves their offsets: a
        state part's segment is a few KiB, and planning its views anew took
        longer than its copy."""
        scatter = self.local_index is not None and not self.local_run
        key = ("copies", self.remote_spec, self.wire_dims, self.local_positions, self.local_token, self.local_head, self.kv,
               self.n, self.u, scatter, self.local_block[1])
        template = self.local.cached(key, lambda: CopyTemplate.of(self._copies(payload, scatter), self.local_block, self._blocks(), payload))
        found = None if template is None else template.at(payload, self.local_block)
        if found is None:
            return [c for c, _ in self._copies(payload, scatter)]
        if scatter:
            index = index_on(self.local_index, self.device)  # type: ignore[arg-type]
            return [Copy(c.dst, c.src, index) for c in found]
        return found

    def _blocks(self) -> int:
        """How many blocks the local cache has (each part's canonical view: layer, kv, block, ...)."""
        return min((v if isinstance(v, torch.Tensor) else v[0]).shape[2] for v in self.local.parts)

    def _copies(self, payload: torch.Tensor, scatter: bool) -> list[tuple[Copy, int]]:
        """(copy, bytes from one local block to the next in its destination)."""
        src = wire_canonical(payload.view(move_dtype(self.remote_spec.dtype)), self.remote_spec, *self.wire_dims)
        out = []
        index = index_on(self.local_index, self.device) if scatter else None  # type: ignore[arg-type]
        for dst, layers, kv, step in self._targets(scatter):
            if index is not None:
                out.append((Copy(*widen(dst, src[layers, kv]), index), 0))  # one scatter for every block
            else:
                out.append((Copy(*widen(to_units(dst, self.n, self.u), to_units(src[layers, kv], self.n, self.u))), step))
        return out

    def put_copies(self, payload: torch.Tensor) -> list[Copy]:
        """The copies that put ``payload`` (uint8, on this sink's device) in
        place: one flat copy where the wire bytes have the local layout, else
        the relayout's."""
        direct = self.direct()
        if direct is None:
            return self.copies(payload)
        return [Copy(direct.reshape(-1).view(torch.uint8), payload)]

    def put(self, payload: torch.Tensor, run: CopyRunner = run_copies, wait: bool = True) -> None:
        """This segment's wire bytes (uint8) into local memory: one copy
        where they already have its layout, else ``land``. With ``wait``
        False, GPU work is left queued on the caller's stream, for the caller
        to wait on before it reports the blocks landed."""
        direct = self.direct()
        if direct is None:
            self.land(payload, run, wait)
            return
        direct.reshape(-1).view(torch.uint8).copy_(payload, non_blocking=True)
        if wait and (direct.is_cuda or payload.is_cuda):  # either end on a GPU: the copy may still be queued
            torch.cuda.current_stream((direct if direct.is_cuda else payload).device).synchronize()

    def land(self, payload: torch.Tensor, run: CopyRunner = run_copies, wait: bool = True) -> None:
        """Relayout ``payload`` (uint8, this segment's bytes) into local memory;
        ``run`` executes the copies (the daemon's copy threads, on host memory).

        On a GPU the payload goes up in one copy and the relayout runs there,
        on the caller's current stream; it has finished when this returns,
        because the caller then reports the blocks landed, unless ``wait`` is
        False: then the caller waits for its stream before it does."""
        device = self.device
        if payload.device != device:
            # Not non_blocking into host memory: the relayout below reads it at once.
            payload = payload.to(device, non_blocking=device.type == "cuda")
        copies = self.copies(payload)
        if device.type == "cuda":
            run_copies(copies)
            if wait:
                torch.cuda.current_stream(device).synchronize()
        else:
            run(copies)


@dataclass(frozen=True)
class _CopyShape:
    dst: torch.Tensor  # the local view at the template's first block
    block_step: int  # dst elements from one local block to the next
    src_dtype: torch.dtype
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int  # src elements from the payload's start


@dataclass(frozen=True)
class CopyTemplate:
    """A segment shape's relayout copies as strides: where each copy reads in
    the payload and writes from the shape's first local block."""

    block: int
    blocks: int  # the local blocks there are: a run moved past them is no view of the cache (as_strided checks only the storage)
    shapes: tuple[_CopyShape, ...]

    @classmethod
    def of(cls, copies: list[tuple[Copy, int]], run: tuple[int, int], blocks: int, payload: torch.Tensor) -> CopyTemplate | None:
        """``copies`` (made for ``payload``, landing on the local blocks
        ``run``, (start, count), of the ``blocks`` the cache has, each copy
        with its destination's block step in bytes) as a template; None where
        a copy is not a plain view of the payload."""
        shapes = []
        for c, step in copies:
            item = c.dst.element_size()
            if step % item or c.src.untyped_storage().data_ptr() != payload.untyped_storage().data_ptr():
                return None
            offset = c.src.data_ptr() - payload.data_ptr()
            if offset % c.src.element_size():
                return None
            shapes.append(_CopyShape(c.dst, step // item, c.src.dtype, tuple(c.src.shape), c.src.stride(), offset // c.src.element_size()))
        return cls(run[0], blocks, tuple(shapes))

    def at(self, payload: torch.Tensor, run: tuple[int, int]) -> list[Copy] | None:
        """The copies for ``payload`` landing on the local blocks ``run``;
        None where the run is not within the cache's blocks or the payload's
        start does not allow a copy's element size (the caller then makes
        them from scratch, and fails as that does)."""
        block = run[0]
        if block < 0 or block + run[1] > self.blocks:
            return None
        out = []
        try:
            for s in self.shapes:
                base = payload.view(s.src_dtype)
                src = base.as_strided(s.src_size, s.src_stride, base.storage_offset() + s.src_offset)
                dst = s.dst
                if block != self.block:
                    dst = dst.as_strided(dst.shape, dst.stride(), dst.storage_offset() + (block - self.block) * s.block_step)
                out.append(Copy(dst, src))
        except RuntimeError:  # view(dtype): the payload's start or size is not a multiple of it
            return None
        return out
