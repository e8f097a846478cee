"""KV cache specs and engine shapes, for workers: ``kvd.core.spec`` is their home."""

from kvd.core.spec import (
    CANONICAL,
    CPU_ATTENTION_PARTS,
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
    "CANONICAL", "CPU_ATTENTION_PARTS", "DTYPE_SIZES", "KNOWN_DIMS", "NAMED_LAYOUTS", "EngineLayout", "EngineMeta", "GroupSpec", "KVCacheSpec",
    "LayerSpec", "ModelInfo", "TensorRef", "WorkerId", "compat_fields", "fingerprint", "infer_spec", "layout_name",
    "parse_layout", "physical_order",
]
