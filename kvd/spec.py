"""KV cache specs and engine shapes, for workers: ``kvd.core.spec`` is their home."""

from kvd.core.spec import (
    CANONICAL,
    DTYPE_SIZES,
    KNOWN_DIMS,
    NAMED_LAYOUTS,
    EngineLayout,
    EngineMeta,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    ModelInfo,
    TensorRef,
    WorkerId,
    compat_fields,
    fingerprint,
    infer_spec,
    layout_name,
    parse_layout,
    physical_order,
)

__all__ = [
    "CANONICAL", "DTYPE_SIZES", "KNOWN_DIMS", "NAMED_LAYOUTS", "EngineLayout", "EngineMeta", "GroupSpec", "KVCacheSpec",
    "LayerSpec", "ModelInfo", "TensorRef", "WorkerId", "compat_fields", "fingerprint", "infer_spec", "layout_name",
    "parse_layout", "physical_order",
]
