"""Wire view to local view as one strided copy (torch; CPU or GPU).

Every tensor kvd touches -- a registered cache tensor, the bytes of a DATA
frame -- is turned into the same canonical view::

    (layer, kv, block, token, head, dim)

by ``canonical``, which only permutes, renames and inserts size-1 dims. A
relayout between any two layouts, block sizes and head slices is then
``dst_view.copy_(src_view)`` on two such views, after both are reshaped to the
extent's ``(n, u, B)`` unit form (see plan.py). There is no per-layout code.

Data moves as same-width integers (``MOVE_DTYPES``) so no float ever gets
canonicalised and any 1-byte dtype (fp8 variants) is just bytes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from kvd.core.errors import InvalidArgument
from kvd.core.spec import DTYPE_SIZES, GroupSpec, KVCacheSpec, TensorRef

FULL_CANONICAL = ("layer", "kv", "block", "token", "head", "dim")
MOVE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Dims that are other names for canonical ones: an opaque span sits where the
# head dim does (its token/kv structure is hidden), and a "part" index (K and V
# as separate tensors) is the kv dim.
_ALIASES = {"span": "dim", "part": "kv"}


def move_dtype(dtype: str) -> torch.dtype:
    return MOVE_DTYPES[DTYPE_SIZES[dtype]]


def canonical(t: torch.Tensor, dims: Sequence[str]) -> torch.Tensor:
    """View ``t`` (whose dims are named ``dims``) as the 6-D canonical view."""
    names = [_ALIASES.get(d, d) for d in dims]
    if len(names) != t.dim():
        raise ValueError(f"{len(names)} dim names for a {t.dim()}-D tensor")
    for d in FULL_CANONICAL:
        if d not in names:
            t = t.unsqueeze(-1)
            names.append(d)
    return t.permute([names.index(d) for d in FULL_CANONICAL])


def tensor_view(region: torch.Tensor, ref: TensorRef, spec: KVCacheSpec) -> torch.Tensor:
    """A registered tensor as a strided view of its region (uint8 bytes)."""
    itemsize = spec.itemsize
    if ref.offset_bytes % itemsize:
        raise InvalidArgument("tensor.offset_bytes", ref.offset_bytes, f"is not a multiple of the itemsize {itemsize}")
    extent = 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True)) if all(ref.shape) else 0
    end = ref.offset_bytes + extent * itemsize
    if end > region.numel():
        raise InvalidArgument(
            "tensor.shape", list(ref.shape),
            f"with stride {list(ref.stride)} at offset {ref.offset_bytes} ends at byte {end}, past region '{ref.region_id}' of {region.numel()} bytes",
        )
    usable = region.numel() // itemsize * itemsize
    typed = region[:usable].view(move_dtype(spec.dtype))
    return typed.as_strided(ref.shape, ref.stride, ref.offset_bytes // itemsize)


def layer_canonical(region_views: Sequence[tuple[torch.Tensor, TensorRef]]) -> list[torch.Tensor]:
    """One layer's parts as canonical views (each with a layer dim of 1).

    A part holding only K (or only V) gets a kv dim of 1; which plane it is
    is given by ``TensorRef.kv_index`` and handled by ``GroupTensors``.
    """
    return [canonical(view.unsqueeze(0), ("layer", *ref.dims)) for view, ref in region_views]


def stack_layers(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Join per-layer canonical views into one when the layers sit at a constant
    stride in one buffer (vLLM allocates them so), else None."""
    if len(views) == 1:
        return views[0]
    first = views[0]

    def key(v: torch.Tensor) -> tuple[object, ...]:
        # Strides of size-1 dims carry no meaning (and differ with shape order).
        strides = tuple(s for n, s in zip(v.shape[1:], v.stride()[1:], strict=True) if n > 1)
        return (tuple(v.shape), strides, v.untyped_storage().data_ptr())

    if any(key(v) != key(first) for v in views):
        return None
    offs = [v.storage_offset() for v in views]
    step = offs[1] - offs[0]
    if step == 0 or any(b - a != step for a, b in itertools.pairwise(offs)):
        return None
    shape = (len(views), *first.shape[1:])
    stride = (step, *first.stride()[1:])
    return first.as_strided(shape, stride, offs[0])


_UNBUILT = object()
T = TypeVar("T")


@dataclass
class GroupTensors:
    """A group's registered caches on one rank, as canonical views.

    ``parts[p]`` is either one stacked view of all layers or a list of
    per-layer views; ``kv_of_part[p]`` is the kv plane a K-only/V-only part
    holds (None when the part carries the whole kv dim).
    """

    spec: KVCacheSpec
    layer_indices: tuple[int, ...]
    parts: list[torch.Tensor | list[torch.Tensor]]
    kv_of_part: list[int | None]
    # Piece templates of batched segments by shape (see transfer.PieceTemplate):
    # addresses into these tensors, so they live exactly as long as the views.
    templates: dict[tuple[object, ...], Any] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: tuple[object, ...], build: Callable[[], T]) -> T:
        """What ``build`` makes for ``key`` (a segment's shape, a view's
        rows), made once: views and templates of these tensors."""
        # Several connection threads share a group: read the cache once, and
        # return what was built, not a second lookup another thread may clear.
        found = self.templates.get(key, _UNBUILT)
        if found is _UNBUILT:
            if len(self.templates) >= 1024:  # shapes are few; this only bounds a pathological reader
                self.templates.clear()
            found = self.templates[key] = build()
        return found  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        first = self.parts[0]
        return (first if isinstance(first, torch.Tensor) else first[0]).device

    @classmethod
    def build(cls, group: GroupSpec, regions: dict[str, torch.Tensor]) -> GroupTensors:
        spec = group.spec
        per_layer: list[list[torch.Tensor]] = []
        kv_of_part: list[int | None] = []
        for li, layer in enumerate(group.layers):
            views = []
            for ref in layer.tensors:
                region = regions.get(ref.region_id)
                if region is None:
                    raise InvalidArgument("tensor.region_id", ref.region_id, "names no region of this registration")
                views.append((tensor_view(region, ref, spec), ref))
            per_layer.append(layer_canonical(views))
            kvs = [None if ref.kv_index < 0 else ref.kv_index for ref in layer.tensors]
            if li == 0:
                kv_of_part = kvs
            elif kvs != kv_of_part:
                raise InvalidArgument(f"layers[{layer.name}].tensors", kvs, f"differ from the first layer's {kv_of_part}")
        parts: list[torch.Tensor | list[torch.Tensor]] = []
        for p in range(len(kv_of_part)):
            layer_views = [layer[p] for layer in per_layer]
            stacked = stack_layers(layer_views)
            parts.append(stacked if stacked is not None else layer_views)
        return cls(spec, group.layer_indices, parts, kv_of_part)

    def layer_runs(self, part: int, positions: Sequence[int]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first index into ``positions``, count, canonical view of those layers)."""
        view = self.parts[part]
        i = 0
        while i < len(positions):
            j = i + 1
            if isinstance(view, torch.Tensor):
                while j < len(positions) and positions[j] == positions[j - 1] + 1:
                    j += 1
                yield i, j - i, view[positions[i] : positions[i] + (j - i)]
            else:
                yield i, 1, view[positions[i]]
            i = j


def _block_views(group: GroupTensors, block: int) -> list[torch.Tensor]:
    """One block of ``group``, as a view per part, layer and K/V plane
    (canonical dims 0, 1 and 2): each covers one block's bytes of one plane,
    not a span across a whole stacked buffer."""
    out = []
    for part in group.parts:
        for v in part if isinstance(part, list) else [part]:
            if v.shape[2] > block:
                one = v.narrow(2, block, 1)
                out += [one[layer, kv] for layer in range(one.shape[0]) for kv in range(one.shape[1])]
    return out


def _spans(views: Sequence[torch.Tensor]) -> np.ndarray:
    """Each view's address range ``[start, end)``, as an (n, 2) array."""
    out = np.empty((len(views), 2), dtype=np.int64)
    for i, v in enumerate(views):
        reach = sum((n - 1) * abs(st) for n, st in zip(v.shape, v.stride(), strict=True))
        out[i] = v.data_ptr(), v.data_ptr() + (reach + 1) * v.element_size()
    return out


def _bytes_of(v: torch.Tensor, scratch: torch.Tensor, base: int) -> torch.Tensor:
    """The bytes ``v`` covers, as a view of ``scratch`` (which stands for the memory from address ``base``)."""
    size = v.element_size()
    return scratch.as_strided((*v.shape, size), (*(st * size for st in v.stride()), 1), v.data_ptr() - base)


def _views_overlap(a: torch.Tensor, b: torch.Tensor, span: tuple[int, int]) -> bool:
    """Whether two strided views (of one block and plane each), whose ranges
    meet on ``span``, share a byte: exactly, so interleaved views (a state
    page's x and B columns) are told apart. The same start with the same
    shape is the same bytes (vLLM's overlaid layers) at once."""
    if a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride():
        return True
    lo, hi = span
    scratch = torch.zeros(hi - lo, dtype=torch.uint8)  # one block of one plane: small
    _bytes_of(a, scratch, lo).fill_(1)
    return bool(_bytes_of(b, scratch, lo).any())


def sharing_groups(groups: Sequence[GroupTensors]) -> tuple[tuple[int, int], ...]:
    """Pairs of positions (i < j) whose groups hold one block id in the same
    bytes: groups overlaid on one buffer, as vLLM's hybrid allocator lays
    them out. A request may give a block id to only one of them. (A state
    group's parts each hold their own bytes of a block's page: they are not
    pairs, and share the state's block id.) Judged on block 1, exactly; the
    address ranges are compared all at once first (numpy)."""
    views = [_block_views(g, 1) for g in groups]
    spans = [_spans(v) for v in views]
    pairs = []
    for i, j in itertools.combinations(range(len(groups)), 2):
        if not len(views[i]) or not len(views[j]) or groups[i].device != groups[j].device:
            continue
        a, b = spans[i], spans[j]
        meet = (a[:, None, 0] < b[None, :, 1]) & (b[None, :, 0] < a[:, None, 1])
        for x, y in zip(*np.nonzero(meet), strict=True):
            span = (int(min(a[x, 0], b[y, 0])), int(max(a[x, 1], b[y, 1])))
            if _views_overlap(views[i][x], views[j][y], span):
                pairs.append((i, j))
                break
    return tuple(pairs)


def index_on(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``idx`` (block ids, on the host) on ``device``. To a GPU it goes
    through pinned memory: an upload from pageable memory waits for the
    whole stream first, which would stall every copy queued before it."""
    if idx.device == device:
        return idx
    if device.type == "cuda" and idx.device.type == "cpu":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx.to(device)


def gather_blocks(view: torch.Tensor, dim: int, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``view.index_select(dim, idx)``, fast for any strides.

    torch gathers element by element from a source that is not contiguous
    unless it gathers along dim 0 (vLLM's CPU K, transposed and interleaved
    with V: 0.006 GB/s). So a strided source is gathered in its own memory
    order along dim 0, where each block is a run of dense pieces, and
    permuted to the asked order in one strided copy."""
    if view.is_contiguous():
        if out is not None and out.is_contiguous() and out.device == view.device:
            return torch.index_select(view, dim, idx, out=out)
        got = view.index_select(dim, idx)
        return got if out is None else out.copy_(got)
    strides = view.stride()
    order = sorted(range(view.dim()), key=lambda d: -strides[d] if view.shape[d] > 1 else 0)
    at = order.index(dim)
    gathered = view.permute(order).movedim(at, 0).index_select(0, idx).movedim(0, at)
    back = gathered.permute([order.index(d) for d in range(view.dim())])
    return back if out is None else out.copy_(back)


def select(
    view: torch.Tensor, block: tuple[int, int], token: tuple[int, int], head: tuple[int, int], kv: tuple[int, int] | None = None
) -> torch.Tensor:
    """Restrict a canonical view to block, token, head (and kv) ranges, each (start, count)."""
    kv_slice = slice(None) if kv is None else slice(kv[0], kv[0] + kv[1])
    return view[:, kv_slice, block[0] : block[0] + block[1], token[0] : token[0] + token[1], head[0] : head[0] + head[1]]


def to_units(view: torch.Tensor, n: int, u: int) -> torch.Tensor:
    """Reshape a canonical view of one extent side to ``(layer, kv, n, u, tokens/u|B, head, dim)``.

    The big side (``n`` blocks of ``u`` units) splits its token dim; the small
    side (``n*u`` blocks of one unit) splits its block dim. Both are views.
    """
    blocks, tokens = view.shape[2], view.shape[3]
    if blocks == n:
        return view.unflatten(3, (u, tokens // u))
    if blocks == n * u:
        return view.unflatten(2, (n, u))
    raise ValueError(f"extent side of {blocks} blocks fits neither n={n} nor n*u={n * u}")


@functools.lru_cache(maxsize=4096)  # planning asks for the same few shapes once per segment
def wire_shape(spec: KVCacheSpec, layers: int, blocks: int, tokens: int, heads: int, kvs: int = 0) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Shape and dim names of one segment's bytes as the owner sends them:
    layers, then parts, then the owner's physical dims restricted. ``kvs`` is
    the number of K/V planes carried (0 = all of them)."""
    kvs = kvs or spec.num_kv
    sizes = dict(spec.dim_sizes())
    sizes["block"] = blocks
    if "token" in sizes:
        sizes["token"] = tokens
    if "kv" in sizes:
        sizes["kv"] = kvs
    sizes["head"] = heads
    dims: tuple[str, ...] = ("layer", "part", *spec.layout)
    parts = kvs if spec.parts_per_layer == 2 else 1
    shape = (layers, parts, *(sizes[d] for d in spec.layout))
    return shape, dims


def wire_canonical(buf: torch.Tensor, spec: KVCacheSpec, layers: int, blocks: int, tokens: int, heads: int, kvs: int = 0) -> torch.Tensor:
    """Canonical view of a DATA payload (``buf`` in the move dtype)."""
    shape, dims = wire_shape(spec, layers, blocks, tokens, heads, kvs)
    t = buf.view(shape)
    if spec.parts_per_layer == 1:
        t = t.squeeze(1)
        dims = tuple(d for d in dims if d != "part")
    return canonical(t, dims)


def physical(view: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """Inverse of canonical for one part of one layer run: canonical (layer, kv,
    block, token, head, dim) back to (layer, *spec.layout) order."""
    order = ["layer", *(_ALIASES.get(d, d) for d in spec.layout)]
    t = view
    # Squeeze from the back so earlier axes keep their index.
    for axis in reversed(range(len(FULL_CANONICAL))):
        if FULL_CANONICAL[axis] not in order:
            t = t.squeeze(axis)
    remaining = [d for d in FULL_CANONICAL if d in order]
    return t.permute([remaining.index(d) for d in order])


# ------------------------------------------------------------ copies to run

# Data moves as bytes, so a strided copy may treat each innermost run as
# wider integers: torch copies per element, and 8-byte elements move a
# 256-byte head row 1.4x faster than 2-byte ones (measured, one thread).
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16)


def widen(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` viewed with the widest integer element both allow
    (same dtype, innermost dim dense in both), else as they are."""
    if dst.dtype != src.dtype or dst.dim() == 0 or dst.shape[-1] != src.shape[-1] or dst.stride(-1) != 1 or src.stride(-1) != 1:
        return dst, src
    row = dst.shape[-1] * dst.element_size()
    for dtype in _WIDE_DTYPES:
        if dtype.itemsize <= dst.element_size():
            break
        if row % dtype.itemsize:
            continue
        try:
            return dst.view(dtype), src.view(dtype)
        except RuntimeError:  # an outer stride or the offset is not a multiple of the wider size
            continue
    return dst, src


@dataclass(frozen=True)
class Copy:
    """One strided copy of a relayout: ``dst.copy_(src)``, or with ``index``
    a scatter of ``src``'s blocks (dim 2) to those blocks of ``dst``."""

    dst: torch.Tensor
    src: torch.Tensor
    index: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.src.numel() * self.src.element_size()

    def run(self) -> None:
        if self.index is None:
            self.dst.copy_(self.src)
        else:
            self.dst[:, :, self.index] = self.src

    def split(self, parts: int) -> list[Copy]:
        """At most ``parts`` copies of about equal bytes, cut along the dim of
        ``src`` with the widest stride among those with at least ``parts``
        entries: each part then reads one dense stretch of the source. (Cut
        along K/V of a blocks-first source, two threads read alternate 32 KiB
        pieces of the same pages: 0.6x a memcpy in the relayout bench, against
        0.75-1.0x cut along its blocks.)"""
        dims = [d for d in range(self.src.dim() - 1) if self.src.shape[d] >= parts]
        d = max(dims, key=lambda d: abs(self.src.stride()[d]), default=None)
        if parts <= 1 or d is None:
            return [self]
        size = self.src.shape[d]
        bounds = [size * i // parts for i in range(parts + 1)]
        out = []
        for lo, hi in itertools.pairwise(bounds):
            src = self.src.narrow(d, lo, hi - lo)
            if self.index is None:
                out.append(Copy(self.dst.narrow(d, lo, hi - lo), src))
            elif d == 2:  # cutting the scattered blocks: the index goes with them
                out.append(Copy(self.dst, src, self.index[lo:hi]))
            else:
                out.append(Copy(self.dst.narrow(d, lo, hi - lo), src, self.index))
        return out


def split_copies(copies: Sequence[Copy], parts: int, min_bytes: int) -> list[Copy]:
    """``copies`` cut so that ``parts`` threads can share them, none smaller
    than ``min_bytes`` (handing a copy to a thread costs tens of us)."""
    total = sum(c.nbytes for c in copies)
    if parts <= 1 or total < 2 * min_bytes:
        return list(copies)
    share = max(min_bytes, total // parts)
    out: list[Copy] = []
    for c in copies:
        n = min(parts, c.nbytes // share)
        out.extend(c.split(n) if n > 1 else [c])
    return out


# What executes a relayout's copies: ``run_copies`` here, the daemon's copy
# threads in the shell (transport/copy_threads.py).
CopyRunner = Callable[[Sequence[Copy]], None]


def run_copies(copies: Sequence[Copy]) -> None:
    """Run copies one after the other on this thread (the default runner)."""
    for c in copies:
        c.run()
