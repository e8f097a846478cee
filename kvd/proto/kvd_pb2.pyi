from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVCacheSpec(_message.Message):
    __slots__ = ("block_size", "num_kv_heads", "head_size", "dtype", "layout", "use_mla", "num_blocks", "span_size", "span_format", "total_heads")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    USE_MLA_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPAN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPAN_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HEADS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layout: _containers.RepeatedScalarFieldContainer[str]
    use_mla: bool
    num_blocks: int
    span_size: int
    span_format: str
    total_heads: int
    def __init__(self, block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., layout: _Optional[_Iterable[str]] = ..., use_mla: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., span_size: _Optional[int] = ..., span_format: _Optional[str] = ..., total_heads: _Optional[int] = ...) -> None: ...

class TensorView(_message.Message):
    __slots__ = ("region_id", "offset_bytes", "shape", "stride", "dims", "kv_index")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    offset_bytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    dims: _containers.RepeatedScalarFieldContainer[str]
    kv_index: int
    def __init__(self, region_id: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., dims: _Optional[_Iterable[str]] = ..., kv_index: _Optional[int] = ...) -> None: ...

class LayerRegistration(_message.Message):
    __slots__ = ("name", "layer_index", "tensors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    layer_index: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorView]
    def __init__(self, name: _Optional[str] = ..., layer_index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorView, _Mapping]]] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("group_id", "spec", "layers", "kind", "window_tokens")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    spec: KVCacheSpec
    layers: _containers.RepeatedCompositeFieldContainer[LayerRegistration]
    kind: str
    window_tokens: int
    def __init__(self, group_id: _Optional[int] = ..., spec: _Optional[_Union[KVCacheSpec, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerRegistration, _Mapping]]] = ..., kind: _Optional[str] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("region_id", "size_bytes", "shm", "cuda_ipc")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    size_bytes: int
    shm: ShmSource
    cuda_ipc: CudaIpcSource
    def __init__(self, region_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., shm: _Optional[_Union[ShmSource, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcSource, _Mapping]] = ...) -> None: ...

class ShmSource(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CudaIpcSource(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class WorkerId(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "tp_size", "pp_rank", "pp_size")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("num_layers", "total_num_kv_heads")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    total_num_kv_heads: int
    def __init__(self, num_layers: _Optional[int] = ..., total_num_kv_heads: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "model", "regions", "groups", "worker_token", "alive_shm")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    WORKER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ALIVE_SHM_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    model: ModelInfo
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    worker_token: bytes
    alive_shm: str
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ..., worker_token: _Optional[bytes] = ..., alive_shm: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("registration_generation", "registered_bytes", "daemon_epoch", "worker_token")
    REGISTRATION_GENERATION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    registration_generation: int
    registered_bytes: int
    daemon_epoch: str
    worker_token: bytes
    def __init__(self, registration_generation: _Optional[int] = ..., registered_bytes: _Optional[int] = ..., daemon_epoch: _Optional[str] = ..., worker_token: _Optional[bytes] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids", "first_token")
    IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ...) -> None: ...

class TransferParams(_message.Message):
    __slots__ = ("remote_engine_id", "remote_address", "remote_epoch", "request_id", "generation", "capability", "block_ids", "num_tokens", "remote_tp_size", "remote_pp_size", "lease_seconds", "stream")
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    remote_engine_id: str
    remote_address: str
    remote_epoch: str
    request_id: str
    generation: int
    capability: bytes
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    remote_tp_size: int
    remote_pp_size: int
    lease_seconds: float
    stream: bool
    def __init__(self, remote_engine_id: _Optional[str] = ..., remote_address: _Optional[str] = ..., remote_epoch: _Optional[str] = ..., request_id: _Optional[str] = ..., generation: _Optional[int] = ..., capability: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., remote_tp_size: _Optional[int] = ..., remote_pp_size: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., stream: _Optional[bool] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("worker", "request_id", "block_ids", "num_tokens", "capability", "reader_engine_id", "lease_seconds", "stream", "verify", "computed_at_unix_nanos")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_AT_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    request_id: str
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    capability: bytes
    reader_engine_id: str
    lease_seconds: float
    stream: bool
    verify: str
    computed_at_unix_nanos: int
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., capability: _Optional[bytes] = ..., reader_engine_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., stream: _Optional[bool] = ..., verify: _Optional[str] = ..., computed_at_unix_nanos: _Optional[int] = ...) -> None: ...

class LayersSavedRequest(_message.Message):
    __slots__ = ("worker", "request_ids", "layers_saved")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_SAVED_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    layers_saved: int
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ..., request_ids: _Optional[_Iterable[str]] = ..., layers_saved: _Optional[int] = ...) -> None: ...

class LayersSavedResponse(_message.Message):
    __slots__ = ("advanced",)
    ADVANCED_FIELD_NUMBER: _ClassVar[int]
    advanced: int
    def __init__(self, advanced: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: TransferParams
    def __init__(self, params: _Optional[_Union[TransferParams, _Mapping]] = ...) -> None: ...

class PublishEngineRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "block_ids", "num_tokens", "capability", "reader_engine_id", "lease_seconds", "verify", "computed_at_unix_nanos")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_AT_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    capability: bytes
    reader_engine_id: str
    lease_seconds: float
    verify: str
    computed_at_unix_nanos: int
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., capability: _Optional[bytes] = ..., reader_engine_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., verify: _Optional[str] = ..., computed_at_unix_nanos: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker", "request_id", "params", "local_block_ids", "priority", "tenant", "deadline_ms")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    request_id: str
    params: TransferParams
    local_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    priority: str
    tenant: str
    deadline_ms: float
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ..., request_id: _Optional[str] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ..., local_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., priority: _Optional[str] = ..., tenant: _Optional[str] = ..., deadline_ms: _Optional[float] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("worker", "request_id", "release")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    request_id: str
    release: TransferParams
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ..., request_id: _Optional[str] = ..., release: _Optional[_Union[TransferParams, _Mapping]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetFinishedRequest(_message.Message):
    __slots__ = ("worker", "resume_after")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    resume_after: int
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ..., resume_after: _Optional[int] = ...) -> None: ...

class GetFinishedResponse(_message.Message):
    __slots__ = ("finished_sending", "finished_recving", "invalid_block_ids", "details", "seq")
    FINISHED_SENDING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_RECVING_FIELD_NUMBER: _ClassVar[int]
    INVALID_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    finished_sending: _containers.RepeatedScalarFieldContainer[str]
    finished_recving: _containers.RepeatedScalarFieldContainer[str]
    invalid_block_ids: _containers.RepeatedScalarFieldContainer[int]
    details: _containers.RepeatedCompositeFieldContainer[FinishedDetail]
    seq: int
    def __init__(self, finished_sending: _Optional[_Iterable[str]] = ..., finished_recving: _Optional[_Iterable[str]] = ..., invalid_block_ids: _Optional[_Iterable[int]] = ..., details: _Optional[_Iterable[_Union[FinishedDetail, _Mapping]]] = ..., seq: _Optional[int] = ...) -> None: ...

class FinishedDetail(_message.Message):
    __slots__ = ("request_id", "direction", "outcome", "reason", "bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    direction: str
    outcome: str
    reason: str
    bytes: int
    def __init__(self, request_id: _Optional[str] = ..., direction: _Optional[str] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class EngineFinishedRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class SetExpectedFinishedCountRequest(_message.Message):
    __slots__ = ("engine_id", "expected_finished_count")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FINISHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    expected_finished_count: int
    def __init__(self, engine_id: _Optional[str] = ..., expected_finished_count: _Optional[int] = ...) -> None: ...

class SetExpectedFinishedCountResponse(_message.Message):
    __slots__ = ("expected_finished_count",)
    EXPECTED_FINISHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    expected_finished_count: int
    def __init__(self, expected_finished_count: _Optional[int] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("tp_rank", "pp_rank", "groups", "regions", "registration")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    pp_rank: int
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    registration: int
    def __init__(self, tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., registration: _Optional[int] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "epoch", "host_id", "data_address", "tp_size", "pp_size", "model", "ranks", "fingerprint", "features", "kvd_version", "wire_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    KVD_VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: str
    host_id: str
    data_address: str
    tp_size: int
    pp_size: int
    model: ModelInfo
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    fingerprint: str
    features: _containers.RepeatedScalarFieldContainer[str]
    kvd_version: str
    wire_version: int
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[str] = ..., host_id: _Optional[str] = ..., data_address: _Optional[str] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., fingerprint: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., kvd_version: _Optional[str] = ..., wire_version: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: EngineInfo
    def __init__(self, caller: _Optional[_Union[EngineInfo, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("callee", "data_token")
    CALLEE_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    callee: EngineInfo
    data_token: bytes
    def __init__(self, callee: _Optional[_Union[EngineInfo, _Mapping]] = ..., data_token: _Optional[bytes] = ...) -> None: ...

class PeerAbortRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "generation", "capability", "reason")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    generation: int
    capability: bytes
    reason: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., generation: _Optional[int] = ..., capability: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("request_id", "generation", "capability")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generation: int
    capability: bytes
    def __init__(self, request_id: _Optional[str] = ..., generation: _Optional[int] = ..., capability: _Optional[bytes] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("engine_id", "reader_engine_id", "leases")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reader_engine_id: str
    leases: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    def __init__(self, engine_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("alive",)
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    alive: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, alive: _Optional[_Iterable[bool]] = ...) -> None: ...

class ReportFinishedRequest(_message.Message):
    __slots__ = ("engine_id", "worker", "details", "invalid_block_ids", "sender_epoch", "seq")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    INVALID_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SENDER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    worker: WorkerId
    details: _containers.RepeatedCompositeFieldContainer[FinishedDetail]
    invalid_block_ids: _containers.RepeatedScalarFieldContainer[int]
    sender_epoch: str
    seq: int
    def __init__(self, engine_id: _Optional[str] = ..., worker: _Optional[_Union[WorkerId, _Mapping]] = ..., details: _Optional[_Iterable[_Union[FinishedDetail, _Mapping]]] = ..., invalid_block_ids: _Optional[_Iterable[int]] = ..., sender_epoch: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class ReportFinishedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "capability", "wait_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    capability: bytes
    wait_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., capability: _Optional[bytes] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("generation", "epoch", "ranks_published", "block_ids", "num_tokens", "stream", "lease_seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANKS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    epoch: str
    ranks_published: int
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    stream: bool
    lease_seconds: float
    def __init__(self, generation: _Optional[int] = ..., epoch: _Optional[str] = ..., ranks_published: _Optional[int] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., stream: _Optional[bool] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class DigestRows(_message.Message):
    __slots__ = ("group_id", "layers", "head_start", "head_stop", "token_start", "token_stop", "bin_tokens")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_STOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STOP_FIELD_NUMBER: _ClassVar[int]
    BIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    head_start: int
    head_stop: int
    token_start: int
    token_stop: int
    bin_tokens: int
    def __init__(self, group_id: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., head_start: _Optional[int] = ..., head_stop: _Optional[int] = ..., token_start: _Optional[int] = ..., token_stop: _Optional[int] = ..., bin_tokens: _Optional[int] = ...) -> None: ...

class DigestRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "generation", "capability", "rows")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    generation: int
    capability: bytes
    rows: _containers.RepeatedCompositeFieldContainer[DigestRows]
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., generation: _Optional[int] = ..., capability: _Optional[bytes] = ..., rows: _Optional[_Iterable[_Union[DigestRows, _Mapping]]] = ...) -> None: ...

class GroupDigest(_message.Message):
    __slots__ = ("group_id", "sums")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_id: _Optional[int] = ..., sums: _Optional[_Iterable[int]] = ...) -> None: ...

class DigestResponse(_message.Message):
    __slots__ = ("seed", "per_window", "groups")
    SEED_FIELD_NUMBER: _ClassVar[int]
    PER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    seed: int
    per_window: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupDigest]
    def __init__(self, seed: _Optional[int] = ..., per_window: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupDigest, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("engine_id", "epoch", "workers", "peers", "publications", "pulls_in_flight", "version", "leases", "pulls", "recent_failures", "staging_buffers", "staging_bytes", "tasks", "draining", "pinned_ranks", "queues")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PUBLICATIONS_FIELD_NUMBER: _ClassVar[int]
    PULLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STAGING_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PINNED_RANKS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    peers: _containers.RepeatedScalarFieldContainer[str]
    publications: int
    pulls_in_flight: int
    version: str
    leases: _containers.RepeatedCompositeFieldContainer[LeaseStatus]
    pulls: _containers.RepeatedCompositeFieldContainer[PullStatus]
    recent_failures: _containers.RepeatedCompositeFieldContainer[FailureStatus]
    staging_buffers: int
    staging_bytes: int
    tasks: int
    draining: bool
    pinned_ranks: int
    queues: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., peers: _Optional[_Iterable[str]] = ..., publications: _Optional[int] = ..., pulls_in_flight: _Optional[int] = ..., version: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[LeaseStatus, _Mapping]]] = ..., pulls: _Optional[_Iterable[_Union[PullStatus, _Mapping]]] = ..., recent_failures: _Optional[_Iterable[_Union[FailureStatus, _Mapping]]] = ..., staging_buffers: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., tasks: _Optional[int] = ..., draining: _Optional[bool] = ..., pinned_ranks: _Optional[int] = ..., queues: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ...) -> None: ...

class QueueStatus(_message.Message):
    __slots__ = ("priority", "tenant", "waiting", "moving", "granted_bytes", "side")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MOVING_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    priority: str
    tenant: str
    waiting: int
    moving: int
    granted_bytes: int
    side: str
    def __init__(self, priority: _Optional[str] = ..., tenant: _Optional[str] = ..., waiting: _Optional[int] = ..., moving: _Optional[int] = ..., granted_bytes: _Optional[int] = ..., side: _Optional[str] = ...) -> None: ...

class LeaseStatus(_message.Message):
    __slots__ = ("request_id", "generation", "ranks", "expires_in_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generation: int
    ranks: _containers.RepeatedScalarFieldContainer[str]
    expires_in_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[str]] = ..., expires_in_seconds: _Optional[float] = ...) -> None: ...

class PullStatus(_message.Message):
    __slots__ = ("request_id", "worker", "remote_engine_id", "age_seconds", "phase", "landed_bytes", "planned_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LANDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker: str
    remote_engine_id: str
    age_seconds: float
    phase: str
    landed_bytes: int
    planned_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., worker: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., age_seconds: _Optional[float] = ..., phase: _Optional[str] = ..., landed_bytes: _Optional[int] = ..., planned_bytes: _Optional[int] = ...) -> None: ...

class FailureStatus(_message.Message):
    __slots__ = ("request_id", "reason", "message", "age_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    message: str
    age_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker", "regions", "bytes", "layers", "region_ids")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REGION_IDS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerId
    regions: int
    bytes: int
    layers: int
    region_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker: _Optional[_Union[WorkerId, _Mapping]] = ..., regions: _Optional[int] = ..., bytes: _Optional[int] = ..., layers: _Optional[int] = ..., region_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("engine_id", "epoch", "data_token", "shared_token", "lane")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: str
    data_token: bytes
    shared_token: bytes
    lane: str
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[str] = ..., data_token: _Optional[bytes] = ..., shared_token: _Optional[bytes] = ..., lane: _Optional[str] = ...) -> None: ...

class DataRead(_message.Message):
    __slots__ = ("owner_engine_id", "request_id", "generation", "capability", "tp_rank", "pp_rank", "head_start", "head_count", "segments", "reader_tp_rank", "reader_pp_rank", "nixl_metadata_version", "stripe", "stripes", "stream", "mapped_registration", "priority", "tenant", "deadline_ms")
    OWNER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    READER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    READER_PP_RANK_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_VERSION_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    STRIPES_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MAPPED_REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    owner_engine_id: str
    request_id: str
    generation: int
    capability: bytes
    tp_rank: int
    pp_rank: int
    head_start: int
    head_count: int
    segments: _containers.RepeatedCompositeFieldContainer[DataSegment]
    reader_tp_rank: int
    reader_pp_rank: int
    nixl_metadata_version: int
    stripe: int
    stripes: int
    stream: bool
    mapped_registration: int
    priority: str
    tenant: str
    deadline_ms: float
    def __init__(self, owner_engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., generation: _Optional[int] = ..., capability: _Optional[bytes] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., head_start: _Optional[int] = ..., head_count: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[DataSegment, _Mapping]]] = ..., reader_tp_rank: _Optional[int] = ..., reader_pp_rank: _Optional[int] = ..., nixl_metadata_version: _Optional[int] = ..., stripe: _Optional[int] = ..., stripes: _Optional[int] = ..., stream: _Optional[bool] = ..., mapped_registration: _Optional[int] = ..., priority: _Optional[str] = ..., tenant: _Optional[str] = ..., deadline_ms: _Optional[float] = ...) -> None: ...

class DataSegment(_message.Message):
    __slots__ = ("group_id", "layers", "block_start", "block_count", "token_start", "token_count", "kv_start", "kv_count", "block_ids", "head_start", "head_count")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    KV_START_FIELD_NUMBER: _ClassVar[int]
    KV_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    block_start: int
    block_count: int
    token_start: int
    token_count: int
    kv_start: int
    kv_count: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    head_start: int
    head_count: int
    def __init__(self, group_id: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., block_start: _Optional[int] = ..., block_count: _Optional[int] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., kv_start: _Optional[int] = ..., kv_count: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., head_start: _Optional[int] = ..., head_count: _Optional[int] = ...) -> None: ...

class DataEnd(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class DataDescriptors(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "metadata_version", "addrs", "lengths", "counts")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    METADATA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    metadata_version: int
    addrs: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., metadata_version: _Optional[int] = ..., addrs: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class DataError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
