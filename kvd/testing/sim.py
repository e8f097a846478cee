"""In-memory engines: the planning and relayout core without a network (tests, bench).

A rank's caches live in a plain uint8 tensor standing in for a region; the
transfer runs plan_pull -> serve_segment -> SegmentSink.land, which is
exactly what the daemons do around the data plane.
"""

from __future__ import annotations

import ctypes
import math
import random
from dataclasses import dataclass

import torch

from kvd.core import iov
from kvd.core.engine_meta import EngineLayout, EngineMeta
from kvd.core.groups import FULL_ATTENTION, STATE_PART, GroupKind
from kvd.core.pieces import owner_iov, serve_segment
from kvd.core.reads import Offer
from kvd.core.relayout import GroupTensors
from kvd.core.spec import GroupSpec, KVCacheSpec, LayerSpec, ModelInfo, TensorRef
from kvd.core.topology import heads_of_rank
from kvd.core.transfer import plan_pull
from kvd.state_parts import StateShape
from kvd.testing import pattern
from kvd.transport.base import Staging


@dataclass
class SimRank:
    tp_rank: int
    pp_rank: int
    group: GroupSpec
    tensors: GroupTensors
    coords: pattern.RankCoords


@dataclass
class SimEngine:
    meta: EngineMeta
    ranks: dict[tuple[int, int], SimRank]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def make_rank_tensors(spec: KVCacheSpec, layers: list[int], rng: random.Random, *, stacked: bool = True, shuffle_dims: bool = True,
                      shuffle_memory: bool = False, kind: GroupKind = FULL_ATTENTION, fill: bool = True) -> tuple[GroupSpec, GroupTensors]:
    """One rank's registered tensors in a fresh buffer. ``shuffle_memory``
    stores each part in a random order of the spec's dims (not the wire
    order), as vLLM's CPU attention stores K."""
    part = spec.part_shape()
    numel = math.prod(part)
    nbytes_part = numel * spec.itemsize
    parts = spec.parts_per_layer
    # Non-stacked: irregular padding between layers, so no single layer stride exists.
    pads = [0 if stacked else rng.randrange(0, 4) * 64 for _ in range(len(layers) * parts)]
    total = sum(nbytes_part + p for p in pads) + 64
    # fill=False: memory never touched (planning alone), so big caches cost no RAM.
    buf = torch.zeros(total, dtype=torch.uint8) if fill else torch.empty(total, dtype=torch.uint8)
    strides = contiguous_strides(part)
    off = 0
    layer_specs = []
    k = 0
    for idx in layers:
        refs = []
        for p in range(parts):
            off += pads[k]
            k += 1
            if shuffle_memory:  # dim i's stride, when memory holds the dims in `mem` order
                mem = rng.sample(range(len(part)), len(part))
                mem_strides = contiguous_strides(tuple(part[i] for i in mem))
                strides = tuple(mem_strides[mem.index(i)] for i in range(len(part)))
            order = list(range(len(part)))
            if shuffle_dims:
                rng.shuffle(order)  # shape order need not be physical order
            refs.append(TensorRef(
                "r", off, tuple(part[i] for i in order), tuple(strides[i] for i in order),
                tuple(spec.layout[i] for i in order), p if parts == 2 else -1,
            ))
            off += nbytes_part
        layer_specs.append(LayerSpec(f"model.layers.{idx}.attn", idx, tuple(refs)))
    group = GroupSpec(0, spec, tuple(layer_specs), kind)
    return group, GroupTensors.build(group, {"r": buf})


def make_engine(engine_id: str, tp: int, pp: int, model: ModelInfo, spec_of, rng: random.Random, *, stacked: bool = True, use_mla: bool = False,
                shuffle_memory: bool = False, kind: GroupKind = FULL_ATTENTION, fill: bool = True) -> SimEngine:
    """An engine of one KV cache group of ``kind`` (full attention by default)."""
    per = -(-model.num_layers // pp)
    ranks = {}
    layouts = []
    for pp_rank in range(pp):
        layers = list(range(pp_rank * per, min(model.num_layers, (pp_rank + 1) * per)))
        for tp_rank in range(tp):
            spec = spec_of(tp_rank)
            group, tensors = make_rank_tensors(spec, layers, rng, stacked=stacked, shuffle_memory=shuffle_memory, kind=kind, fill=fill)
            coords = pattern.RankCoords(heads_of_rank(tp_rank, tp, model.total_num_kv_heads, use_mla).start)
            ranks[(tp_rank, pp_rank)] = SimRank(tp_rank, pp_rank, group, tensors, coords)
            layouts.append(EngineLayout(tp_rank, pp_rank, (group,)))
    meta = EngineMeta(engine_id, "epoch-" + engine_id, "host", "x:1", tp, pp, model, tuple(layouts))
    return SimEngine(meta, ranks)


def transfer(p: SimEngine, d: SimEngine, request_id: str, p_ids: list[int], d_ids: list[int], num_tokens: int, *,
             segment_bytes: int = 1 << 16, zero_copy_min_bytes: int = 0, p_first: int = 0, d_first: int = 0) -> dict[tuple[int, int], int]:
    """Run every D rank's pull against P in memory; returns bytes read per P
    rank. Each side's ids hold the tokens from its ``*_first`` token on."""
    params = Offer(request_id=request_id, generation=1, capability=b"", block_ids=(tuple(p_ids),), num_tokens=num_tokens,
                   first_tokens=(p_first,))
    staging = Staging()
    read_bytes: dict[tuple[int, int], int] = {}
    for (tp, pp), rank in d.ranks.items():
        reads = plan_pull(
            local_meta=d.meta, local_tp_rank=tp, local_pp_rank=pp, local_groups=[rank.tensors], local_group_specs=[rank.group],
            remote=p.meta, params=params, local_block_ids=[d_ids], segment_bytes=segment_bytes,
            zero_copy_min_bytes=zero_copy_min_bytes, local_first_tokens=[d_first],
        )
        for rr in reads:
            owner = p.ranks[(rr.read.tp_rank, rr.read.pp_rank)]
            for seg, sink in zip(rr.read.segments, rr.sinks, strict=True):
                key = (rr.read.tp_rank, rr.read.pp_rank)
                read_bytes[key] = read_bytes.get(key, 0) + sink.nbytes
                dst = sink.iov()
                src = owner_iov(owner.tensors, seg, *rr.read.heads_of(seg)) if dst is not None else None
                if dst is not None and src is not None and iov.nbytes(src) == sink.nbytes:
                    # What the same-host path does: piece to piece, from the two templates.
                    for (d_addr, n), (s_addr, _) in zip(*iov.align(dst, src), strict=True):
                        ctypes.memmove(int(d_addr), int(s_addr), int(n))
                    continue
                payload = serve_segment(owner.tensors, seg, *rr.read.heads_of(seg), staging)
                assert payload.numel() == sink.nbytes
                sink.put(payload.clone())  # as a transport does; the clone: the payload may be a view of P's memory
    return read_bytes


@dataclass
class StateRank:
    """One rank of a model with state only: each state part a group, all
    views of one page buffer (as vLLM keeps a Mamba layer's state)."""

    buffer: torch.Tensor
    groups: list[GroupSpec]
    tensors: list[GroupTensors]

    def coords(self, tp_rank: int) -> list[pattern.RankCoords]:
        """Where each part's local heads sit among the part's heads."""
        return [pattern.RankCoords(tp_rank * g.spec.num_kv_heads) for g in self.groups]


def make_state_engine(engine_id: str, shape: StateShape, tp: int, layers: tuple[int, ...], num_blocks: int) -> tuple[EngineMeta, list[StateRank]]:
    """An engine of TP ``tp`` whose layers are all state layers of ``shape``,
    each page padded after its state, as vLLM pads them."""
    page_bytes = shape.page_bytes(tp) + 32
    ranks = []
    for _ in range(tp):
        buf = torch.zeros(len(layers) * num_blocks * page_bytes, dtype=torch.uint8)
        pages = buf.view(len(layers), num_blocks, page_bytes)
        named = {f"model.layers.{layer}.mixer": pages[i] for i, layer in enumerate(layers)}
        groups, tensors = [], []
        for pi, (spec, views) in enumerate(shape.layer_parts(named, tp)):
            refs = tuple(LayerSpec(name, layer, (TensorRef("r", v.data_ptr() - buf.data_ptr(), tuple(v.shape), tuple(v.stride()), spec.layout),))
                         for layer, (name, v) in zip(layers, views.items(), strict=True))
            g = GroupSpec(pi, spec, refs, STATE_PART)
            groups.append(g)
            tensors.append(GroupTensors.build(g, {"r": buf}))
        ranks.append(StateRank(buf, groups, tensors))
    meta = EngineMeta(engine_id, "epoch-" + engine_id, "host", "x:1", tp, 1, ModelInfo(len(layers), 0),
                      tuple(EngineLayout(r, 0, tuple(ranks[r].groups)) for r in range(tp)))
    return meta, ranks
