"""How vLLM's KV caches look to kvd: which KV cache group each layer is in,
what the group attends to, and how vLLM's CPU attention lays out a layer.

Imported by the connector (``kvd.integrations.vllm``) inside vLLM's worker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kvd.caches import KVCacheTensors, cpu_attention_parts
from kvd.errors import KvdError
from kvd.spec import (
    CHUNKED_LOCAL,
    CPU_ATTENTION_PARTS,
    FULL_ATTENTION,
    NAMED_LAYOUTS,
    SLIDING_WINDOW,
    GroupKind,
    KVCacheSpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.kvd")


def request_amx_permission() -> None:
    """Ask Linux for AMX tile state now, before kvd's gRPC client starts threads.

    vLLM's CPU attention uses AMX for bfloat16 and asks for the permission
    lazily (arch_prctl ARCH_REQ_XCOMP_PERM). The kernel refuses it once the
    process has a thread whose signal stack is too small for AMX state, and
    the first AMX instruction then dies with SIGILL. Asking first is harmless
    where there is no AMX (the call just fails).
    """
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata)


# CPU attention kernels whose span order CPU_ATTENTION_PARTS describes (K
# transposed, V row-major): vLLM's vec and vec16, and NEON's FMLA path. AMX
# and NEON's BFMMLA tile K and V for their matrix units.
_STRIDED_CPU_KERNELS = {"vec", "vec16"}


def _cpu_attention_isa(vc: VllmConfig, block_size: int, head_size: int) -> str:
    """The kernel vLLM's CPU attention picks for these caches (it decides the span's order)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return "unknown"
    return str(_get_attn_isa(vc.model_config.dtype, block_size, head_size, vc.cache_config.cache_dtype))


def cpu_cache_registration(vc: VllmConfig, caches: Mapping[str, torch.Tensor]) -> tuple[KVCacheSpec, dict[str, KVCacheTensors], Any]:
    """vLLM's CPU caches, [blocks, heads, tokens, 2*head_size] per layer, as kvd
    registers them: two strided parts where the kernel's span order is known,
    so block-size changes and head slices are kvd's ordinary relayout; else an
    opaque span tagged with its kernel, which pairs only with its own kind."""
    first = next(iter(caches.values()))
    blocks, heads, tokens, width = first.shape
    dtype = str(first.dtype).removeprefix("torch.")
    isa = _cpu_attention_isa(vc, tokens, width // 2)
    neon_fmla = isa == "neon" and dtype != "bfloat16"
    if isa in _STRIDED_CPU_KERNELS or neon_fmla:
        spec = KVCacheSpec(block_size=tokens, num_kv_heads=heads, head_size=width // 2, dtype=dtype,
                           layout=NAMED_LAYOUTS["CPU"], num_blocks=blocks)
        return spec, {name: cpu_attention_parts(t) for name, t in caches.items()}, CPU_ATTENTION_PARTS
    log.info("kvd: CPU attention kernel %s tiles its cache: moving whole spans (block sizes must match)", isa)
    spec = KVCacheSpec(block_size=tokens, num_kv_heads=heads, head_size=width // 2, dtype=dtype, layout=NAMED_LAYOUTS["OPAQUE"],
                       num_blocks=blocks, span_size=tokens * width, span_format=f"vllm-cpu-{isa}-{dtype}")
    return spec, {name: t.view(blocks, heads, tokens * width) for name, t in caches.items()}, NAMED_LAYOUTS["OPAQUE"]


def _group_kind(spec: Any) -> GroupKind:
    """kvd's name for what a vLLM KV cache group's layers attend to."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, SlidingWindowSpec):
        # vLLM keeps extra_retained_tokens more (speculative decoding re-prefills them): so does kvd.
        return GroupKind(SLIDING_WINDOW, int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupKind(CHUNKED_LOCAL, int(spec.attention_chunk_size))
    if isinstance(spec, AttentionSpec):
        # With the hybrid allocator off, windowed layers share the full
        # layers' group (and block table): every token is kept and moved.
        return FULL_ATTENTION
    raise KvdError(f"kvd does not move {type(spec).__name__} KV cache groups yet (Mamba and linear-attention state)")


def layer_groups(kv_cache_config: Any, kv_caches: Mapping[str, torch.Tensor]) -> list[tuple[GroupKind, dict[str, torch.Tensor]]]:
    """This worker's caches by vLLM KV cache group, in vLLM's group order.

    Under the hybrid allocator, layer i of every group overlays the same
    bytes (their block ids never collide), so a layer is its name in its
    group, never its pointer. Names in no group (KV sharing borrows another
    layer's cache) are not moved.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        # No config (an older vLLM): one group; layers sharing one cache move once.
        unique: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, t in kv_caches.items():
            if (t.data_ptr(), tuple(t.shape)) not in seen:
                seen.add((t.data_ptr(), tuple(t.shape)))
                unique[name] = t
        return [(FULL_ATTENTION, unique)]
    out = []
    for i, g in enumerate(groups):
        caches = {name: kv_caches[name] for name in g.layer_names if name in kv_caches}
        if not caches:
            raise KvdError(f"KV cache group {i} has no layer on this worker ({list(g.layer_names)[:3]}...)")
        out.append((_group_kind(g.kv_cache_spec), caches))
    return out
