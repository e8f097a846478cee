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
    STATE_PART,
    GroupKind,
    KVCacheSpec,
)
from kvd.state_parts import DS, SD, ConvPart, StateShape

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
        MambaSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        return STATE_PART
    if isinstance(spec, SlidingWindowSpec):
        # vLLM keeps extra_retained_tokens more (speculative decoding re-prefills them): so does kvd.
        return GroupKind(SLIDING_WINDOW, int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupKind(CHUNKED_LOCAL, int(spec.attention_chunk_size))
    if isinstance(spec, AttentionSpec):
        # With the hybrid allocator off, windowed layers share the full
        # layers' group (and block table): every token is kept and moved.
        return FULL_ATTENTION
    raise KvdError(f"kvd does not move {type(spec).__name__} KV cache groups yet")


def layer_groups(kv_cache_config: Any, kv_caches: Mapping[str, torch.Tensor]) -> list[tuple[GroupKind, dict[str, torch.Tensor], Any]]:
    """This worker's caches by vLLM KV cache group, in vLLM's group order,
    with each group's vLLM spec (None without a config).

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
        return [(FULL_ATTENTION, unique, None)]
    out = []
    for i, g in enumerate(groups):
        caches = {name: kv_caches[name] for name in g.layer_names if name in kv_caches}
        if not caches:
            raise KvdError(f"KV cache group {i} has no layer on this worker ({list(g.layer_names)[:3]}...)")
        out.append((_group_kind(g.kv_cache_spec), caches, g.kv_cache_spec))
    return out


def rebind_layers(vc: VllmConfig, kv_caches: Mapping[str, torch.Tensor]) -> None:
    """Have every layer take its cache again from the tensor kvd registered.

    kvd moves CPU caches into shared memory by re-pointing the very tensors
    vLLM passed; but a layer that keeps views of its own (a Mamba layer's
    conv and SSM state, cut from its page by ``bind_kv_cache``) would still
    compute on the old memory, which no transfer reaches."""
    context = vc.compilation_config.static_forward_context
    for name, t in kv_caches.items():
        layer = context.get(name)
        if layer is not None and hasattr(layer, "bind_kv_cache"):
            layer.bind_kv_cache(t)


def _dtype_name(dt: Any) -> str:
    return str(dt).removeprefix("torch.")


# Where model configs keep Mamba2's group count (Mamba2 and Nemotron-H;
# Granite 4.0-H and Falcon-H1; Zamba2), as vLLM's models read it.
_N_GROUPS_FIELDS = ("n_groups", "mamba_n_groups", "mamba_ngroups")


def mamba_n_groups(vc: VllmConfig) -> int | None:
    """The model's Mamba2 group count (B and C heads), or None where its config names none."""
    hf = vc.model_config.hf_text_config
    for name in _N_GROUPS_FIELDS:
        value = getattr(hf, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def state_shape(spec: Any, tp_size: int, n_groups: int | None = None) -> StateShape:
    """A vLLM ``MambaSpec`` (this rank's state shapes) as kvd's state parts:
    the conv state cut into its sub-projections the way each mixer shards
    them over TP (NIXL's ``derive_mamba_conv_split`` reads them alike).

    ``n_groups`` is the model's Mamba2 group count: where it is smaller than
    TP, vLLM gives every rank one group (``extra_groups_for_head_shards``),
    a replica of the model's single one, so B and C have ``n_groups``
    distinct heads, not one a rank.

    Refused by name: state kvd cannot slice exactly (other mixers, TP-replicated state)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if getattr(spec, "tp_replicated", False) or len(spec.shapes) != 2:
        raise KvdError(f"kvd does not move this {kind} state ({len(spec.shapes)} tensors, tp_replicated={spec.tp_replicated})")
    layout = DS if is_conv_state_dim_first() else SD
    conv, ssm = tuple(spec.shapes[0]), tuple(spec.shapes[1])
    conv_dim, rows = (conv[0], conv[1]) if layout == DS else (conv[1], conv[0])
    parts: tuple[ConvPart, ...]
    if kind == "MAMBA2":  # conv over x | B | C; SSM (heads, head_dim, d_state)
        heads, head_dim, d_state = ssm
        groups = (conv_dim - heads * head_dim) // 2 // d_state
        total_groups = groups * tp_size
        if n_groups is not None and n_groups < tp_size:
            if groups != 1 or tp_size % n_groups:
                raise KvdError(f"{kind} state: {groups} groups a rank for the model's n_groups={n_groups} at TP{tp_size}: not vLLM's replication")
            total_groups = n_groups  # each rank holds a replica
        parts = (ConvPart("x", heads * tp_size, head_dim), ConvPart("B", total_groups, d_state), ConvPart("C", total_groups, d_state))
        ssm_heads, ssm_width = heads, head_dim * d_state
    elif kind == "GDN_ATTN":  # conv over q | k | v; SSM (v_heads, v_dim, k_dim)
        v_heads, v_dim, k_dim = ssm
        k_heads = (conv_dim - v_heads * v_dim) // 2 // k_dim
        parts = (ConvPart("q", k_heads * tp_size, k_dim), ConvPart("k", k_heads * tp_size, k_dim), ConvPart("v", v_heads * tp_size, v_dim))
        ssm_heads, ssm_width = v_heads, v_dim * k_dim
    elif kind == "MAMBA1":  # conv over x; SSM (intermediate, d_state)
        parts = (ConvPart("x", conv_dim * tp_size, 1),)
        ssm_heads, ssm_width = ssm[0], ssm[1]
    else:
        raise KvdError(f"kvd does not move {kind} state: it knows how Mamba1, Mamba2 and gated delta-net shard theirs over TP")
    shape = StateShape(parts, rows, _dtype_name(spec.dtypes[0]), ssm_heads * tp_size, ssm_width, _dtype_name(spec.dtypes[1]), layout)
    if shape.conv_dim(tp_size) != conv_dim:
        raise KvdError(f"{kind} conv state of {conv_dim} columns does not split into {[p.name for p in parts]} of {shape.conv_dim(tp_size)}")
    return shape


def group_parts(kv_cache_config: Any, tp_size: int) -> list[int]:
    """How many kvd groups each vLLM KV cache group becomes: one, or a
    state group's parts (each of them carries the group's block ids)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    out = [len(state_shape(g.kv_cache_spec, tp_size).part_names()) if isinstance(g.kv_cache_spec, MambaSpec) else 1 for g in groups]
    return out or [1]
