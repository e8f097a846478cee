"""Worker-side KV cache memory: allocate in shared memory, adopt existing
tensors into it in place, and describe tensors for registration.

The daemon maps registered memory itself, so CPU caches must live in POSIX
shared memory. ``allocate_kv_caches`` makes vLLM-style per-layer tensors that
are views into one shm buffer; ``adopt_into_shm`` moves the storage of
tensors you already have into shm (one copy, once, at registration) and
re-points the same tensor objects at it.

Each region is named for this process and holds a shared lock on its file
while it is mapped: the daemon reads the lock, free once the process ends,
to tell that a worker died without unregistering (``kvd.regions.shm``).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvd.convert import region_to_pb, spec_to_pb
from kvd.core.requests import Region, ShmSource
from kvd.errors import InvalidArgument
from kvd.proto import kvd_pb2 as pb
from kvd.regions.shm import PAGE, ShmRegion, unlink_name
from kvd.spec import FULL_ATTENTION, STATE_PART, GroupKind, KVCacheSpec

# The public API (tests/test_public_api.py pins it).
__all__ = [
    "Described", "KVCacheTensors", "ShmRegion", "adopt_into_shm", "alive_token", "allocate_cpu_attention_caches", "allocate_kv_caches",
    "allocate_state_pages", "cpu_attention_parts", "describe", "layer_index_of", "local_group_tensors", "release_all", "torch_dtype",
]

KVCacheTensors = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# Regions this process owns, by base address, so any tensor can be described.
_REGIONS: dict[int, ShmRegion] = {}


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgument("dtype", name, "is not a torch dtype")
    return dt


def _shm_bytes(nbytes: int) -> torch.Tensor:
    """A fresh zero-filled shm region this process owns, as bytes (kept, so any tensor in it can be described)."""
    region = ShmRegion.create(nbytes)
    _REGIONS[region.tensor.data_ptr()] = region
    return region.tensor


def allocate_kv_caches(spec: KVCacheSpec, layer_names: Sequence[str], *, shm: bool = True) -> dict[str, KVCacheTensors]:
    """Per-layer cache tensors shaped in ``spec.layout`` order, stacked in one
    buffer (in shm unless ``shm=False``), zero-filled."""
    part = spec.part_shape()
    parts = spec.parts_per_layer
    numel = 1
    for n in part:
        numel *= n
    nbytes = numel * spec.itemsize * parts * len(layer_names)
    flat = _shm_bytes(nbytes) if shm else torch.zeros(nbytes, dtype=torch.uint8)
    typed = flat.view(torch_dtype(spec.dtype)).view(len(layer_names), parts, *part)
    out: dict[str, KVCacheTensors] = {}
    for i, name in enumerate(layer_names):
        out[name] = typed[i, 0] if parts == 1 else (typed[i, 0], typed[i, 1])
    return out


def adopt_into_shm(kv_caches: Mapping[str, KVCacheTensors]) -> dict[str, KVCacheTensors]:
    """Move every distinct CPU storage behind ``kv_caches`` into shared memory,
    in place: the same tensor objects (and their views' shapes and strides)
    now point at shm. Returns ``kv_caches`` for convenience."""
    tensors = [t for v in kv_caches.values() for t in (v if isinstance(v, tuple) else (v,))]
    moved: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.is_cuda:
            raise InvalidArgument("kv_caches", str(t.device), "CUDA tensors register by IPC handle, not shm")
        st = t.untyped_storage()
        key = st.data_ptr()
        if _region_of(key) is not None:
            continue
        if key not in moved:
            flat = _shm_bytes(max(st.nbytes(), 1))
            flat[: st.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(st))
            moved[key] = flat.untyped_storage()
        t.set_(moved[key], t.storage_offset(), t.shape, t.stride())
    return dict(kv_caches)


def _region_of(ptr: int) -> ShmRegion | None:
    for base, region in _REGIONS.items():
        if base <= ptr < base + region.size:
            return region
    return None


_ALIVE: tuple[int, ShmRegion] | None = None  # this process's alive_token, and the pid that made it
_ALIVE_LOCK = threading.Lock()  # two first calls at once would make two, and drop (unlock) one handed out


def alive_token() -> str:
    """The name of a page of shared memory this process holds locked for as
    long as it lives (made once a process). ``KvdClient.register`` sends it
    (``RegisterRequest.alive_shm``): the daemon then tells that the worker
    exited without unregistering from any pid namespace, whatever its memory
    (a CUDA IPC region names no file). Removed at a clean exit; after a kill,
    by the daemon. ``release_all`` leaves it: registrations may outlive it."""
    global _ALIVE
    with _ALIVE_LOCK:
        pid = os.getpid()
        # A forked child makes its own (the lock it inherited is its parent's too), and so
        # does a process whose page was removed (its daemon could not open it any more).
        if _ALIVE is None or _ALIVE[0] != pid or _ALIVE[1].removed():
            _ALIVE = (pid, ShmRegion.create(PAGE))
            atexit.register(_remove_alive, pid, _ALIVE[1].name)
        return _ALIVE[1].name


def _remove_alive(pid: int, name: str) -> None:
    if os.getpid() == pid:  # not a forked child's exit
        unlink_name(name)


def release_all() -> None:
    """Unlink every shm region this process created."""
    for region in list(_REGIONS.values()):
        region.unlink()
    _REGIONS.clear()


@dataclass(frozen=True)
class Described:
    regions: list[pb.Region]
    groups: list[pb.KVCacheGroup]


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def layer_index_of(name: str, fallback: int) -> int:
    """vLLM layer names carry the global index: model.layers.12.self_attn.attn."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else fallback


def describe(
    groups: Sequence[tuple[KVCacheSpec, Mapping[str, KVCacheTensors]]],
    *,
    dims: Sequence[str] | Sequence[Sequence[str]] | None = None,
    layer_indices: Mapping[str, int] | None = None,
    kinds: Sequence[GroupKind] = (),
) -> Described:
    """Regions and group registrations for tensors in this process's shm.

    ``dims`` names the tensors' dims in *shape* order when that differs from
    the spec's layout (vLLM shapes HND caches as NHD and permutes the
    strides), or, as one tuple per part, when K and V differ
    (``CPU_ATTENTION_PARTS``); by default the shape is in layout order.
    Strides may put a part's memory in any order of the spec's dims.
    ``kinds`` says what each group attends to (full attention by default).
    Groups may overlay one another's memory (vLLM's hybrid allocator does).
    """
    regions: dict[str, pb.Region] = {}
    out_groups = []
    for gid, (spec, caches) in enumerate(groups):
        kind = kinds[gid] if gid < len(kinds) else (STATE_PART if spec.state else FULL_ATTENTION)
        g = pb.KVCacheGroup(group_id=gid, kind=kind.name, window_tokens=kind.window)
        for li, (name, value) in enumerate(caches.items()):
            tensors = value if isinstance(value, tuple) else (value,)
            idx = (layer_indices or {}).get(name, layer_index_of(name, li))
            layer = g.layers.add(name=name, layer_index=idx)
            for ti, t in enumerate(tensors):
                # State parts are kvd's own views (kvd.state_parts), shaped in their layout order.
                tdims = (() if spec.state else _part_dims(dims, ti)) or spec.layout
                if len(tdims) != t.dim():
                    raise InvalidArgument(f"kv_caches[{name}]", list(tdims), f"names {len(tdims)} dims of a {t.dim()}-D tensor")
                if t.is_cuda:
                    from kvd.regions.cuda_ipc import export_storage

                    src = export_storage(t)
                    rid = f"cuda-{src.device}-{t.untyped_storage().data_ptr():x}"
                    base = t.untyped_storage().data_ptr()
                    regions.setdefault(rid, region_to_pb(Region(rid, t.untyped_storage().nbytes(), src)))
                else:
                    region = _region_of(t.data_ptr())
                    if region is None:
                        raise InvalidArgument(f"kv_caches[{name}]", "cpu tensor", "is not in shared memory; use allocate_kv_caches or adopt_into_shm")
                    rid, base = region.name, region.tensor.data_ptr()
                    regions.setdefault(rid, region_to_pb(Region(rid, region.size, ShmSource(region.name))))
                layer.tensors.add(
                    region_id=rid, offset_bytes=t.data_ptr() - base, shape=list(t.shape), stride=list(t.stride()),
                    dims=list(tdims), kv_index=(ti if len(tensors) == 2 else -1),
                )
        g.spec.CopyFrom(spec_to_pb(spec))
        out_groups.append(g)
    return Described(list(regions.values()), out_groups)


def _part_dims(dims: Sequence[str] | Sequence[Sequence[str]] | None, part: int) -> tuple[str, ...]:
    if not dims:
        return ()
    if isinstance(dims[0], str):
        return tuple(dims)  # type: ignore[arg-type]
    return tuple(dims[part])


def allocate_state_pages(layer_names: Sequence[str], num_blocks: int, page_bytes: int) -> dict[str, torch.Tensor]:
    """State layers' pages as vLLM's CPU backend keeps them, ``[num_blocks,
    page_bytes]`` bytes per layer, stacked in one shm buffer, zero-filled."""
    pages = _shm_bytes(len(layer_names) * num_blocks * page_bytes).view(len(layer_names), num_blocks, page_bytes)
    return {name: pages[i] for i, name in enumerate(layer_names)}


def allocate_cpu_attention_caches(spec: KVCacheSpec, layer_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """vLLM CPU attention's per-layer tensors, ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]``, stacked in one shm buffer, zero-filled."""
    shape = (len(layer_names), spec.num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
    typed = _shm_bytes(math.prod(shape) * spec.itemsize).view(torch_dtype(spec.dtype)).view(shape)
    return {name: typed[i] for i, name in enumerate(layer_names)}


def cpu_attention_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one vLLM CPU attention tensor as strided views, shaped in
    the orders ``CPU_ATTENTION_PARTS`` names (K transposed inside each
    (block, head) span, V after it)."""
    blocks, heads, tokens, width = t.shape
    head_size = width // 2
    if width != 2 * head_size or t.stride(3) != 1 or t.stride(2) != width:
        raise InvalidArgument("kv_cache", list(t.shape), "is not a dense vLLM CPU attention tensor [blocks, heads, tokens, 2*head_size]")
    sb, sh = t.stride(0), t.stride(1)
    k = t.as_strided((blocks, heads, head_size, tokens), (sb, sh, tokens, 1), t.storage_offset())
    v = t.as_strided((blocks, heads, tokens, head_size), (sb, sh, head_size, 1), t.storage_offset() + tokens * head_size)
    return k, v


def local_group_tensors(spec: KVCacheSpec, caches: Mapping[str, KVCacheTensors], *, dims: Sequence[str] | Sequence[Sequence[str]] | None = None):  # type: ignore[no-untyped-def]
    """Canonical views of this process's own caches (for filling and checking)."""
    from kvd.convert import group_from_pb
    from kvd.core.relayout import GroupTensors

    described = describe([(spec, caches)], dims=dims)  # a state spec's group is of kind state
    group = group_from_pb(described.groups[0], 0)
    regions = {r.region_id: _regions_by_name()[r.shm.name].tensor for r in described.regions}
    return GroupTensors.build(group, regions)


def _regions_by_name() -> dict[str, ShmRegion]:
    return {r.name: r for r in _REGIONS.values()}
