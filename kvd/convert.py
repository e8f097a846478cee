"""Proto messages <-> core dataclasses. The only module that knows both."""

from __future__ import annotations

from kvd.core.errors import InvalidArgument
from kvd.core.groups import FULL, GroupKind
from kvd.core.reads import DataRead, DataSegment, Offer
from kvd.core.spec import (
    EngineLayout,
    EngineMeta,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    ModelInfo,
    TensorRef,
    WorkerId,
    check_no_overlap,
    parse_layout,
)
from kvd.proto import kvd_pb2 as pb


def worker_from_pb(w: pb.WorkerId) -> WorkerId:
    return WorkerId(w.engine_id, w.tp_rank, max(w.tp_size, 1), w.pp_rank, max(w.pp_size, 1))


def worker_to_pb(w: WorkerId) -> pb.WorkerId:
    return pb.WorkerId(engine_id=w.engine_id, tp_rank=w.tp_rank, tp_size=w.tp_size, pp_rank=w.pp_rank, pp_size=w.pp_size)


def spec_from_pb(s: pb.KVCacheSpec, field: str, *, state: bool = False) -> KVCacheSpec:
    """``state``: the group is of kind state (its kind says so; the spec carries it for relayout)."""
    layout = parse_layout(list(s.layout), field_name=f"{field}.layout")
    try:
        return KVCacheSpec(
            block_size=s.block_size,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_size,
            dtype=s.dtype,
            layout=layout,
            num_blocks=s.num_blocks,
            use_mla=s.use_mla,
            span_size=s.span_size,
            span_format=s.span_format,
            state=state,
            total_heads=s.total_heads,
        )
    except InvalidArgument as e:
        raise e.within("spec", field) from None


def spec_to_pb(s: KVCacheSpec) -> pb.KVCacheSpec:
    return pb.KVCacheSpec(
        block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size, dtype=s.dtype,
        layout=list(s.layout), use_mla=s.use_mla, num_blocks=s.num_blocks, span_size=s.span_size, span_format=s.span_format,
        total_heads=s.total_heads,
    )


def group_from_pb(g: pb.KVCacheGroup, index: int) -> GroupSpec:
    field = f"groups[{index}]"
    kind = kind_from_pb(g, field)
    spec = spec_from_pb(g.spec, f"{field}.spec", state=kind.is_state)
    if not g.layers:
        raise InvalidArgument(f"{field}.layers", 0, "must list at least one layer")
    layers = []
    for li, layer in enumerate(g.layers):
        lf = f"{field}.layers[{layer.name or li}]"
        if len(layer.tensors) != spec.parts_per_layer:
            raise InvalidArgument(f"{lf}.tensors", len(layer.tensors), f"must be {spec.parts_per_layer} for layout {list(spec.layout)}")
        tensors = []
        for ti, t in enumerate(layer.tensors):
            tf = f"{lf}.tensors[{ti}]"
            dims = tuple(t.dims) or spec.layout
            if sorted(dims) != sorted(spec.layout):
                raise InvalidArgument(f"{tf}.dims", list(dims), f"must name the spec's dims {list(spec.layout)}")
            if len(t.shape) != len(dims) or len(t.stride) != len(dims):
                raise InvalidArgument(f"{tf}.shape", list(t.shape), f"and stride {list(t.stride)} must both have {len(dims)} entries")
            expected = spec.dim_sizes()
            for d, n in zip(dims, t.shape, strict=True):
                if n != expected[d]:
                    raise InvalidArgument(f"{tf}.shape[{d}]", n, f"does not match the spec's {d}={expected[d]}")
            kv = t.kv_index
            if spec.parts_per_layer == 2 and kv != ti:
                raise InvalidArgument(f"{tf}.kv_index", kv, f"must be {ti}: separate K and V tensors come in order K, V")
            if spec.parts_per_layer == 1 and kv != -1:
                raise InvalidArgument(f"{tf}.kv_index", kv, "must be -1 for a tensor holding the whole layer")
            # The dims and strides say where every element lies; a part stored in
            # another order than the spec's (wire) layout is gathered, not refused.
            # But each element must have a place of its own.
            check_no_overlap(f"{tf}.stride", tuple(t.shape), tuple(t.stride))
            tensors.append(TensorRef(t.region_id, t.offset_bytes, tuple(t.shape), tuple(t.stride), dims, kv))
        layers.append(LayerSpec(layer.name, layer.layer_index, tuple(tensors)))
    idx = [layer.layer_index for layer in layers]
    if len(set(idx)) != len(idx):
        raise InvalidArgument(f"{field}.layers.layer_index", idx, "repeats a layer")
    return GroupSpec(g.group_id, spec, tuple(layers), kind)


def kind_from_pb(g: pb.KVCacheGroup, field: str) -> GroupKind:
    try:
        return GroupKind(g.kind or FULL, g.window_tokens)
    except InvalidArgument as e:
        raise e.within("group", field) from None


def group_to_pb(g: GroupSpec, *, with_tensors: bool = True) -> pb.KVCacheGroup:
    out = pb.KVCacheGroup(group_id=g.group_id, spec=spec_to_pb(g.spec), kind=g.kind.name, window_tokens=g.kind.window)
    for layer in g.layers:
        lp = out.layers.add(name=layer.name, layer_index=layer.layer_index)
        if with_tensors:
            for t in layer.tensors:
                lp.tensors.add(region_id=t.region_id, offset_bytes=t.offset_bytes, shape=list(t.shape),
                               stride=list(t.stride), dims=list(t.dims), kv_index=t.kv_index)
    return out


def model_from_pb(m: pb.ModelInfo) -> ModelInfo:
    if m.num_layers <= 0:
        raise InvalidArgument("model.num_layers", m.num_layers, "must be positive")
    return ModelInfo(m.num_layers, m.total_num_kv_heads)  # 0 heads: state parts only, checked against the groups


def engine_to_pb(meta: EngineMeta, fingerprint: str, regions: dict[tuple[int, int], tuple[list[pb.Region], int]] | None = None) -> pb.EngineInfo:
    """``regions`` (same-host peers only) adds each rank's memory, tensor
    views and the registration they belong to."""
    return pb.EngineInfo(
        engine_id=meta.engine_id, epoch=meta.epoch, host_id=meta.host_id, data_address=meta.data_address,
        tp_size=meta.tp_size, pp_size=meta.pp_size,
        model=pb.ModelInfo(num_layers=meta.model.num_layers, total_num_kv_heads=meta.model.total_num_kv_heads),
        ranks=[_rank_to_pb(r, regions) for r in meta.ranks],
        fingerprint=fingerprint, features=list(meta.features), kvd_version=meta.kvd_version, wire_version=meta.wire_version,
    )


def _rank_to_pb(r: EngineLayout, regions: dict[tuple[int, int], tuple[list[pb.Region], int]] | None) -> pb.RankInfo:
    mapped, registration = (regions or {}).get((r.tp_rank, r.pp_rank), ([], 0))
    return pb.RankInfo(tp_rank=r.tp_rank, pp_rank=r.pp_rank, groups=[group_to_pb(g, with_tensors=regions is not None) for g in r.groups],
                       regions=mapped, registration=registration)


def engine_from_pb(e: pb.EngineInfo) -> EngineMeta:
    ranks = []
    for r in e.ranks:
        groups = []
        for i, g in enumerate(r.groups):
            field = f"ranks[{r.tp_rank},{r.pp_rank}].groups[{i}]"
            kind = kind_from_pb(g, field)
            spec = spec_from_pb(g.spec, f"{field}.spec", state=kind.is_state)
            layers = tuple(LayerSpec(layer.name, layer.layer_index, ()) for layer in g.layers)
            groups.append(GroupSpec(g.group_id, spec, layers, kind))
        ranks.append(EngineLayout(r.tp_rank, r.pp_rank, tuple(groups)))
    return EngineMeta(
        engine_id=e.engine_id, epoch=e.epoch, host_id=e.host_id, data_address=e.data_address,
        tp_size=e.tp_size, pp_size=e.pp_size, model=ModelInfo(e.model.num_layers, e.model.total_num_kv_heads),
        ranks=tuple(ranks), features=tuple(e.features), kvd_version=e.kvd_version, wire_version=e.wire_version or 1,
    )


def offer_from_pb(p: pb.TransferParams) -> Offer:
    return Offer(p.request_id, p.generation, p.capability, tuple(tuple(b.ids) for b in p.block_ids), p.num_tokens,
                 tuple(int(b.first_token) for b in p.block_ids), p.stream)


def segment_to_pb(s: DataSegment) -> pb.DataSegment:
    return pb.DataSegment(group_id=s.group_id, layers=s.layers, block_start=s.block_start, block_count=s.block_count,
                          token_start=s.token_start, token_count=s.token_count, kv_start=s.kv_start, kv_count=s.kv_count,
                          block_ids=s.block_ids, head_start=s.head_start, head_count=s.head_count)


def read_to_pb(r: DataRead) -> pb.DataRead:
    return pb.DataRead(
        owner_engine_id=r.owner_engine_id, request_id=r.request_id, generation=r.generation, capability=r.capability,
        tp_rank=r.tp_rank, pp_rank=r.pp_rank, head_start=r.head_start, head_count=r.head_count,
        segments=[segment_to_pb(s) for s in r.segments], reader_tp_rank=r.reader_tp_rank, reader_pp_rank=r.reader_pp_rank,
        nixl_metadata_version=r.nixl_metadata_version, stripe=r.stripe, stripes=r.stripes, stream=r.stream,
        mapped_registration=r.mapped_registration,
    )


def read_from_pb(r: pb.DataRead) -> DataRead:
    return DataRead(
        owner_engine_id=r.owner_engine_id, request_id=r.request_id, generation=r.generation, capability=r.capability,
        tp_rank=r.tp_rank, pp_rank=r.pp_rank, head_start=r.head_start, head_count=r.head_count,
        segments=tuple(DataSegment(s.group_id, tuple(s.layers), s.block_start, s.block_count, s.token_start, s.token_count,
                                   s.kv_start, s.kv_count, tuple(s.block_ids), s.head_start, s.head_count) for s in r.segments),
        reader_tp_rank=r.reader_tp_rank, reader_pp_rank=r.reader_pp_rank, nixl_metadata_version=r.nixl_metadata_version,
        stripe=r.stripe, stripes=r.stripes, stream=r.stream, mapped_registration=r.mapped_registration,
    )
