"""Proto messages <-> core dataclasses. The only module that knows both.

The gRPC edge (the service, the peer client, the worker client, the data
plane's codec) converts here once; past it nothing knows protobuf."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvd.core.aggregate import Outcome, WorkerFinished
from kvd.core.digest import DigestAnswer, DigestQuery, DigestRows, RowSample
from kvd.core.engine_meta import EngineLayout, EngineMeta, check_engine
from kvd.core.errors import InvalidArgument
from kvd.core.groups import FULL, GroupKind
from kvd.core.reads import DataRead, DataSegment
from kvd.core.requests import (
    Blocks,
    CudaIpcSource,
    FinishedReport,
    Introduction,
    LeaseRef,
    PeerAbort,
    PublishOrder,
    PullOrder,
    RankMemory,
    Region,
    Registered,
    Registering,
    Resolution,
    ShmSource,
    TransferParams,
)
from kvd.core.session import Descriptors
from kvd.core.spec import (
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


def engine_to_pb(intro: Introduction) -> pb.EngineInfo:
    """An introduction's ``memory`` (same-host peers only) adds each rank's
    regions, tensor views and the registration they belong to."""
    meta = intro.meta
    return pb.EngineInfo(
        engine_id=meta.engine_id, epoch=meta.epoch, host_id=meta.host_id, data_address=meta.data_address,
        tp_size=meta.tp_size, pp_size=meta.pp_size,
        model=pb.ModelInfo(num_layers=meta.model.num_layers, total_num_kv_heads=meta.model.total_num_kv_heads),
        ranks=[_rank_to_pb(r, {(m.tp_rank, m.pp_rank): m for m in intro.memory} if intro.memory else None) for r in meta.ranks],
        fingerprint=intro.fingerprint, features=list(meta.features), kvd_version=meta.kvd_version, wire_version=meta.wire_version,
    )


def _rank_to_pb(r: EngineLayout, memory: dict[tuple[int, int], RankMemory] | None) -> pb.RankInfo:
    m = (memory or {}).get((r.tp_rank, r.pp_rank))
    groups = m.groups if m is not None else r.groups
    return pb.RankInfo(tp_rank=r.tp_rank, pp_rank=r.pp_rank, groups=[group_to_pb(g, with_tensors=memory is not None) for g in groups],
                       regions=[region_to_pb(x) for x in m.regions] if m is not None else [], registration=m.registration if m is not None else 0)


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
    return check_engine(EngineMeta(
        engine_id=e.engine_id, epoch=e.epoch, host_id=e.host_id, data_address=e.data_address,
        tp_size=e.tp_size, pp_size=e.pp_size, model=ModelInfo(e.model.num_layers, e.model.total_num_kv_heads),
        ranks=tuple(ranks), features=tuple(e.features), kvd_version=e.kvd_version, wire_version=e.wire_version or 1,
    ))




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
        mapped_registration=r.mapped_registration, priority=r.priority, tenant=r.tenant, deadline_ms=r.deadline_ms,
    )


def read_from_pb(r: pb.DataRead) -> DataRead:
    return DataRead(
        owner_engine_id=r.owner_engine_id, request_id=r.request_id, generation=r.generation, capability=r.capability,
        tp_rank=r.tp_rank, pp_rank=r.pp_rank, head_start=r.head_start, head_count=r.head_count,
        segments=tuple(DataSegment(s.group_id, tuple(s.layers), s.block_start, s.block_count, s.token_start, s.token_count,
                                   s.kv_start, s.kv_count, tuple(s.block_ids), s.head_start, s.head_count) for s in r.segments),
        reader_tp_rank=r.reader_tp_rank, reader_pp_rank=r.reader_pp_rank, nixl_metadata_version=r.nixl_metadata_version,
        stripe=r.stripe, stripes=r.stripes, stream=r.stream, mapped_registration=r.mapped_registration,
        priority=r.priority, tenant=r.tenant, deadline_ms=r.deadline_ms,
    )


def introduction_from_pb(e: pb.EngineInfo, data_token: bytes = b"") -> Introduction:
    """A peer's EngineInfo, with the memory of each rank that came with regions
    (same host). Memory this daemon cannot use (a tensor view it refuses) is
    left out, saying why: the engine is still met, and read over TCP."""
    meta = engine_from_pb(e)
    try:
        memory = tuple(
            RankMemory(r.tp_rank, r.pp_rank, tuple(region_from_pb(x) for x in r.regions),
                       tuple(group_from_pb(g, i) for i, g in enumerate(r.groups)), r.registration)
            for r in e.ranks if r.regions
        )
    except InvalidArgument as err:
        return Introduction(meta, e.fingerprint, (), data_token, memory_refused=err.message)
    return Introduction(meta, e.fingerprint, memory, data_token)


# ---------------------------------------------------------------- memory

def region_from_pb(r: pb.Region) -> Region:
    kind = r.WhichOneof("source")
    source: ShmSource | CudaIpcSource | None = None
    if kind == "shm":
        source = ShmSource(r.shm.name)
    elif kind == "cuda_ipc":
        c = r.cuda_ipc
        source = CudaIpcSource(c.device, c.handle, c.storage_size_bytes, c.storage_offset_bytes, c.ref_counter_handle,
                               c.ref_counter_offset, c.event_handle, c.event_sync_required)
    return Region(r.region_id, r.size_bytes, source)


def region_to_pb(r: Region) -> pb.Region:
    if isinstance(r.source, ShmSource):
        return pb.Region(region_id=r.region_id, size_bytes=r.size_bytes, shm=pb.ShmSource(name=r.source.name))
    if isinstance(r.source, CudaIpcSource):
        c = r.source
        return pb.Region(region_id=r.region_id, size_bytes=r.size_bytes, cuda_ipc=pb.CudaIpcSource(
            device=c.device, handle=c.handle, storage_size_bytes=c.storage_size_bytes, storage_offset_bytes=c.storage_offset_bytes,
            ref_counter_handle=c.ref_counter_handle, ref_counter_offset=c.ref_counter_offset, event_handle=c.event_handle,
            event_sync_required=c.event_sync_required))
    return pb.Region(region_id=r.region_id, size_bytes=r.size_bytes)


def registering_from_pb(req: pb.RegisterRequest) -> Registering:
    return Registering(worker_from_pb(req.worker), model_from_pb(req.model), tuple(region_from_pb(r) for r in req.regions),
                       tuple(group_from_pb(g, i) for i, g in enumerate(req.groups)), req.worker_token, req.alive_shm)


def registered_to_pb(r: Registered) -> pb.RegisterResponse:
    return pb.RegisterResponse(registration_generation=r.generation, registered_bytes=r.nbytes, daemon_epoch=r.daemon_epoch,
                               worker_token=r.worker_token)


# ---------------------------------------------------------------- requests

def blocks_from_pb(blocks: Iterable[pb.BlockIds]) -> tuple[Blocks, ...]:
    return tuple(Blocks(tuple(b.ids), b.first_token) for b in blocks)


def blocks_to_pb(blocks: Iterable[Blocks]) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=b.ids, first_token=b.first_token) for b in blocks]


def params_from_pb(p: pb.TransferParams) -> TransferParams:
    return TransferParams(
        remote_engine_id=p.remote_engine_id, remote_address=p.remote_address, request_id=p.request_id, capability=p.capability,
        block_ids=blocks_from_pb(p.block_ids), num_tokens=p.num_tokens, remote_epoch=p.remote_epoch, generation=p.generation,
        remote_tp_size=p.remote_tp_size, remote_pp_size=p.remote_pp_size, lease_seconds=p.lease_seconds, stream=p.stream,
    )


def params_to_pb(p: TransferParams) -> pb.TransferParams:
    return pb.TransferParams(
        remote_engine_id=p.remote_engine_id, remote_address=p.remote_address, remote_epoch=p.remote_epoch, request_id=p.request_id,
        generation=p.generation, capability=p.capability, block_ids=blocks_to_pb(p.block_ids), num_tokens=p.num_tokens,
        remote_tp_size=p.remote_tp_size, remote_pp_size=p.remote_pp_size, lease_seconds=p.lease_seconds, stream=p.stream,
    )


def pull_from_pb(req: pb.PullRequest) -> PullOrder:
    return PullOrder(worker_from_pb(req.worker), req.request_id, params_from_pb(req.params), blocks_from_pb(req.local_block_ids),
                     req.priority, req.tenant, req.deadline_ms)


def pull_to_pb(order: PullOrder) -> pb.PullRequest:
    return pb.PullRequest(worker=worker_to_pb(order.worker), request_id=order.request_id, params=params_to_pb(order.params),
                          local_block_ids=blocks_to_pb(order.local), priority=order.priority, tenant=order.tenant, deadline_ms=order.deadline_ms)


def publish_from_pb(req: pb.PublishRequest) -> PublishOrder:
    return PublishOrder(req.request_id, blocks_from_pb(req.block_ids), req.num_tokens, req.capability, req.reader_engine_id,
                        req.lease_seconds, stream=req.stream, worker=worker_from_pb(req.worker), verify=req.verify)


def publish_engine_from_pb(req: pb.PublishEngineRequest) -> PublishOrder:
    return PublishOrder(req.request_id, blocks_from_pb(req.block_ids), req.num_tokens, req.capability, req.reader_engine_id,
                        req.lease_seconds, engine_id=req.engine_id, verify=req.verify)


def publish_to_pb(order: PublishOrder) -> pb.PublishRequest:
    return pb.PublishRequest(worker=worker_to_pb(order.worker) if order.worker else None, request_id=order.request_id,
                             block_ids=blocks_to_pb(order.block_ids), num_tokens=order.num_tokens, capability=order.capability,
                             reader_engine_id=order.reader_engine_id, lease_seconds=order.lease_seconds, stream=order.stream,
                             verify=order.verify)


def resolution_from_pb(r: pb.ResolveResponse) -> Resolution:
    return Resolution(r.generation, r.epoch, r.ranks_published, blocks_from_pb(r.block_ids), r.num_tokens, r.stream, r.lease_seconds)


def resolution_to_pb(r: Resolution) -> pb.ResolveResponse:
    return pb.ResolveResponse(generation=r.generation, epoch=r.epoch, ranks_published=r.ranks_published,
                              block_ids=blocks_to_pb(r.block_ids), num_tokens=r.num_tokens, stream=r.stream, lease_seconds=r.lease_seconds)


def peer_abort_from_pb(r: pb.PeerAbortRequest) -> PeerAbort:
    # The peer's reason goes into P's log and the request's outcome: one line, so it cannot forge a log line.
    return PeerAbort(r.engine_id, r.request_id, r.generation, r.capability, " ".join(r.reason.splitlines()))


def peer_abort_to_pb(a: PeerAbort) -> pb.PeerAbortRequest:
    return pb.PeerAbortRequest(engine_id=a.engine_id, request_id=a.request_id, generation=a.generation, capability=a.capability,
                               reason=a.reason)


def digest_query_to_pb(q: DigestQuery) -> pb.DigestRequest:
    return pb.DigestRequest(engine_id=q.engine_id, request_id=q.request_id, generation=q.generation, capability=q.capability, rows=[
        pb.DigestRows(group_id=r.group_id, layers=r.layers, head_start=r.heads.start, head_stop=r.heads.stop,
                      token_start=r.token_start, token_stop=r.token_stop, bin_tokens=r.bin_tokens) for r in q.rows])


def digest_query_from_pb(q: pb.DigestRequest) -> DigestQuery:
    rows = tuple(DigestRows(r.group_id, tuple(r.layers), range(r.head_start, r.head_stop), r.token_start, r.token_stop, r.bin_tokens)
                 for r in q.rows)
    return DigestQuery(q.engine_id, q.request_id, q.generation, q.capability, rows)


def digest_answer_to_pb(a: DigestAnswer, query: DigestQuery) -> pb.DigestResponse:
    return pb.DigestResponse(seed=a.sample.seed, per_window=a.sample.per_window, groups=[
        pb.GroupDigest(group_id=r.group_id, sums=s.ravel().tolist()) for r, s in zip(query.rows, a.sums, strict=True)])


def digest_answer_from_pb(a: pb.DigestResponse, query: DigestQuery) -> DigestAnswer:
    """The owner's sums as the reader asked them; refused if their shape is not what was asked."""
    if len(a.groups) != len(query.rows):
        raise InvalidArgument("digest.groups", f"<{len(a.groups)} groups>", f"must answer the {len(query.rows)} asked")
    sums = []
    for rows, g in zip(query.rows, a.groups, strict=True):
        if g.group_id != rows.group_id or len(g.sums) != rows.shape[0] * rows.shape[1]:
            raise InvalidArgument(f"digest.groups[{rows.group_id}].sums", f"<{len(g.sums)} sums>", f"must be {rows.shape[0]} x {rows.shape[1]}")
        sums.append(np.asarray(g.sums, dtype=np.uint64).reshape(rows.shape))
    return DigestAnswer(RowSample(a.seed, a.per_window), tuple(sums))


def leases_from_pb(r: pb.RenewLeasesRequest) -> tuple[LeaseRef, ...]:
    return tuple(LeaseRef(x.request_id, x.generation, x.capability) for x in r.leases)


def renew_to_pb(engine_id: str, reader_engine_id: str, leases: Iterable[LeaseRef]) -> pb.RenewLeasesRequest:
    return pb.RenewLeasesRequest(engine_id=engine_id, reader_engine_id=reader_engine_id, leases=[
        pb.LeaseRef(request_id=x.request_id, generation=x.generation, capability=x.capability) for x in leases])


# ---------------------------------------------------------------- outcomes

def details_to_pb(outcomes: Iterable[Outcome]) -> list[pb.FinishedDetail]:
    return [pb.FinishedDetail(request_id=o.request_id, direction=o.direction, outcome=o.outcome, reason=o.reason, bytes=o.bytes)
            for o in outcomes]


def outcome_from_pb(d: pb.FinishedDetail) -> Outcome:
    return Outcome(d.request_id, d.direction, d.outcome, d.reason, d.bytes)


def finished_to_pb(f: WorkerFinished, seq: int = 0) -> pb.GetFinishedResponse:
    return pb.GetFinishedResponse(finished_sending=sorted(f.sending), finished_recving=sorted(f.recving),
                                  invalid_block_ids=sorted(f.invalid_block_ids), details=details_to_pb(f.outcomes()), seq=seq)


def report_to_pb(r: FinishedReport) -> pb.ReportFinishedRequest:
    return pb.ReportFinishedRequest(engine_id=r.engine_id, worker=pb.WorkerId(engine_id=r.engine_id, tp_rank=r.rank[0], pp_rank=r.rank[1]),
                                    invalid_block_ids=sorted(r.finished.invalid_block_ids),
                                    details=details_to_pb(r.finished.outcomes()), sender_epoch=r.sender_epoch, seq=r.seq)


def report_from_pb(r: pb.ReportFinishedRequest) -> FinishedReport:
    out = WorkerFinished(invalid_block_ids=set(r.invalid_block_ids))
    for detail in r.details:  # one or many outcomes of that worker: a batch queued while the aggregator was unreachable
        out.add(outcome_from_pb(detail))
    return FinishedReport(r.engine_id, (r.worker.tp_rank, r.worker.pp_rank), out, r.sender_epoch, r.seq)


# ---------------------------------------------------------------- data plane

def descriptors_to_pb(d: Descriptors) -> pb.DataDescriptors:
    return pb.DataDescriptors(agent_name=d.agent_name, agent_metadata=d.agent_metadata, metadata_version=d.metadata_version,
                              addrs=d.addrs.tolist(), lengths=d.lengths.tolist(), counts=d.counts.tolist())


def descriptors_from_pb(m: pb.DataDescriptors) -> Descriptors:
    return Descriptors(m.agent_name, np.asarray(m.addrs, dtype=np.uint64), np.asarray(m.lengths, dtype=np.uint64),
                       np.asarray(m.counts, dtype=np.int64), m.agent_metadata, m.metadata_version)
