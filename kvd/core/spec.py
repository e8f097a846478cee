"""KV cache specs, and layouts described as data.

A layout is the tuple of a tensor's dim names in *physical* order (outermost
first). Every relayout in kvd is derived from two such tuples: the canonical
per-layer view is ``(kv, block, token, head, dim)``, and any registered tensor
is a permutation of it, with dims it lacks standing in as size 1.

Dim names:

* ``kv``    K and V (2), absent when K and V are separate tensors or for MLA
* ``block`` the block id
* ``token`` the slot inside a block
* ``head``  the KV head, local to the rank
* ``dim``   the head dim (for MLA: the latent width)
* ``span``  an opaque per-(block, head) run of elements whose internal order
  kvd does not know. It stands in for ``kv``, ``token`` and ``dim`` together,
  so it can be sliced by head but never re-blocked. Keep it for layouts that
  really are unknown.

A group's ``layout`` is the order its bytes take on the wire, and by default
the order of its memory too. A registered tensor names its own dims and
strides, so a part may be stored in another order of the same dims (vLLM's
CPU backend keeps K transposed next to V: ``CPU_ATTENTION_PARTS``); every
copy is derived from the strides, so such a part costs a strided gather, not
a special case.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.core.errors import InvalidArgument
from kvd.core.groups import FULL_ATTENTION, GroupKind

CANONICAL: tuple[str, ...] = ("kv", "block", "token", "head", "dim")
KNOWN_DIMS = frozenset(CANONICAL) | {"span"}

# Named layouts, for people and for vLLM's vocabulary. Each is the physical
# dim order of one registered tensor.
NAMED_LAYOUTS: dict[str, tuple[str, ...]] = {
    # vLLM FlashAttention: [2, num_blocks, block_size, num_kv_heads, head_size]
    "NHD": ("kv", "block", "token", "head", "dim"),
    "HND": ("kv", "block", "head", "token", "dim"),
    # FlashInfer: blocks first, [num_blocks, 2, ...]
    "NHD_BLOCKS_FIRST": ("block", "kv", "token", "head", "dim"),
    "HND_BLOCKS_FIRST": ("block", "kv", "head", "token", "dim"),
    # K and V as two tensors per layer
    "NHD_SPLIT": ("block", "token", "head", "dim"),
    "HND_SPLIT": ("block", "head", "token", "dim"),
    # MLA: [num_blocks, block_size, latent]
    "MLA": ("block", "token", "dim"),
    # A per-(block, head) span of unknown order: [num_blocks, num_kv_heads, span]
    "OPAQUE": ("block", "head", "span"),
    # vLLM's CPU attention, K and V as the two strided parts CPU_ATTENTION_PARTS
    # names; on the wire it is HND_SPLIT.
    "CPU": ("block", "head", "token", "dim"),
}

# vLLM's CPU attention backend keeps one tensor per layer shaped
# [num_blocks, num_kv_heads, block_size, 2 * head_size]; inside each
# (block, head) span K is stored transposed ([head_size][block_size]) and V
# follows it row-major ([block_size][head_size]). As data: the memory order of
# each part, K then V, both strided views of that one tensor.
CPU_ATTENTION_PARTS: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("block", "head", "dim", "token"),
    ("block", "head", "token", "dim"),
)

# Bytes per element for the dtypes kvd moves. Data is moved as same-width
# integers, so any 1-byte float (fp8 e4m3, e5m2, ...) is just 1 byte here.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "uint8": 1,
    "int8": 1,
}


def parse_layout(layout: str | Sequence[str], *, field_name: str = "layout") -> tuple[str, ...]:
    """A layout name (``NHD``) or a dim tuple, validated."""
    if isinstance(layout, str):
        key = layout.upper()
        if key not in NAMED_LAYOUTS:
            raise InvalidArgument(
                field_name, layout, f"is not a known layout; use one of {sorted(NAMED_LAYOUTS)} or a dim list"
            )
        return NAMED_LAYOUTS[key]
    dims = tuple(layout)
    unknown = [d for d in dims if d not in KNOWN_DIMS]
    if unknown:
        raise InvalidArgument(field_name, list(dims), f"has unknown dims {unknown}; known: {sorted(KNOWN_DIMS)}")
    if len(set(dims)) != len(dims):
        raise InvalidArgument(field_name, list(dims), "repeats a dim")
    if "block" not in dims:
        raise InvalidArgument(field_name, list(dims), "has no 'block' dim")
    if "span" in dims and ({"kv", "token", "dim"} & set(dims)):
        raise InvalidArgument(field_name, list(dims), "mixes 'span' with kv/token/dim; a span stands for all three")
    if "span" not in dims and not {"token", "dim"} <= set(dims):
        raise InvalidArgument(field_name, list(dims), "needs 'token' and 'dim' (or an opaque 'span')")
    return dims


def layout_name(dims: Sequence[str]) -> str:
    for name, d in NAMED_LAYOUTS.items():
        if tuple(dims) == d:
            return name
    return ",".join(dims)


@dataclass(frozen=True)
class KVCacheSpec:
    """One KV cache group's spec, like vLLM's ``AttentionSpec``.

    ``num_kv_heads`` counts the heads this rank holds. ``layout`` is the
    physical dim order of each registered tensor of the group.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layout: tuple[str, ...]
    num_blocks: int
    use_mla: bool = False
    span_size: int = 0
    # Who wrote an opaque span (a kernel's private order): spans of different
    # formats hold the same numbers in different places, so they never pair.
    span_format: str = ""
    # A state part (a Mamba conv sub-projection or SSM state): one plane, no
    # K/V, split over TP by its own heads; ``block_size`` counts its rows.
    state: bool = False
    # A state part's distinct heads over all TP ranks, where fewer than the
    # ranks: each is replicated on tp_size / total_heads ranks, as vLLM
    # replicates Mamba2's B and C when n_groups=1 at TP2. 0: split evenly
    # (num_kv_heads x tp_size).
    total_heads: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"spec.{name}", value, "must be a positive integer")
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument("spec.dtype", self.dtype, f"is not supported; use one of {sorted(DTYPE_SIZES)}")
        parse_layout(self.layout, field_name="spec.layout")
        if self.use_mla:
            if "kv" in self.layout or "span" in self.layout:
                raise InvalidArgument("spec.layout", list(self.layout), "an MLA cache has one latent: no kv or span dim")
            if self.num_kv_heads != 1:
                raise InvalidArgument("spec.num_kv_heads", self.num_kv_heads, "must be 1 for MLA")
        if self.state and (self.use_mla or "kv" in self.layout or self.opaque):
            raise InvalidArgument("spec.layout", list(self.layout), "a state part has one plane: no kv or span dim, no MLA")
        if self.opaque:
            if self.span_size <= 0:
                raise InvalidArgument("spec.span_size", self.span_size, "must be positive for an opaque layout")
        elif self.span_size:
            raise InvalidArgument("spec.span_size", self.span_size, "is only for opaque layouts")
        if self.span_format and not self.opaque:
            raise InvalidArgument("spec.span_format", self.span_format, "is only for opaque layouts")
        if len(self.span_format) > 64:
            raise InvalidArgument("spec.span_format", self.span_format, "must be at most 64 characters")
        if self.total_heads and (not self.state or self.num_kv_heads != 1 or self.total_heads < 0):
            raise InvalidArgument("spec.total_heads", self.total_heads, "is only for a state part replicated over TP ranks (one head a rank)")

    @property
    def opaque(self) -> bool:
        return "span" in self.layout

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def joined_kv(self) -> bool:
        """K and V live in one tensor (a ``kv`` dim of 2)."""
        return "kv" in self.layout

    @property
    def num_kv(self) -> int:
        """Logical K/V planes per layer: 2, or 1 for MLA, opaque spans and state parts."""
        return 1 if (self.use_mla or self.opaque or self.state) else 2

    def heads_over_tp(self, tp_size: int, model_heads: int) -> int:
        """The group's distinct heads over all ``tp_size`` ranks: the model's KV
        heads, or a state part's own (fewer than the ranks where replicated)."""
        return (self.total_heads or self.num_kv_heads * tp_size) if self.state else model_heads

    @property
    def parts_per_layer(self) -> int:
        """Registered tensors per layer: 2 when K and V are separate tensors."""
        return 1 if (self.joined_kv or self.num_kv == 1) else 2

    def dim_sizes(self) -> dict[str, int]:
        """Size of every dim this spec's tensors carry."""
        sizes = {
            "kv": 2,
            "block": self.num_blocks,
            "token": self.block_size,
            "head": self.num_kv_heads,
            "dim": self.head_size,
            "span": self.span_size,
        }
        return {d: sizes[d] for d in self.layout}

    def part_shape(self) -> tuple[int, ...]:
        sizes = self.dim_sizes()
        return tuple(sizes[d] for d in self.layout)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Bytes one block of one layer occupies (all parts)."""
        per_part = 1
        for d, n in self.dim_sizes().items():
            if d != "block":
                per_part *= n
        return per_part * self.parts_per_layer * self.itemsize

    def compat_key(self) -> tuple[object, ...]:
        """What must match across engines for bytes to mean the same thing."""
        return (self.head_size, self.dtype, self.use_mla, self.opaque, self.span_size if self.opaque else 0, self.span_format, self.state)


@dataclass(frozen=True)
class TensorRef:
    """Where one registered tensor lives: a region and an element view."""

    region_id: str
    offset_bytes: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dims: tuple[str, ...]
    kv_index: int = -1  # -1: holds both K and V (or neither, for MLA/opaque)


@dataclass(frozen=True)
class LayerSpec:
    name: str
    layer_index: int
    tensors: tuple[TensorRef, ...]


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: a spec and the layers that share its block table."""

    group_id: int
    spec: KVCacheSpec
    layers: tuple[LayerSpec, ...]
    kind: GroupKind = FULL_ATTENTION

    def __post_init__(self) -> None:
        if self.kind.is_state != self.spec.state:
            raise InvalidArgument(f"groups[{self.group_id}].kind", self.kind.name, f"must be 'state' exactly when spec.state is set (it is {self.spec.state})")

    @functools.cached_property
    def layer_indices(self) -> tuple[int, ...]:  # cached: planning asks for it per group per pull
        return tuple(layer.layer_index for layer in self.layers)


@dataclass(frozen=True)
class ModelInfo:
    num_layers: int
    total_num_kv_heads: int  # attention's; 0 for a model of state parts only (pure Mamba)


MAX_REQUEST_ID = 256  # vLLM's ids are tens of characters; this bounds what a daemon holds per request
MAX_ENGINE_ID = 128
MAX_EPOCH = 64  # characters of a daemon epoch a peer names (kvd makes 32 hex digits)
# The widest engines served span tens of GPUs a stage (an NVL72 domain: 72)
# and a few stages. Pairing and the owner's count of expected readers walk an
# engine's ranks: unbounded, one worker's or peer's tp_size of 2^31 (valid
# for a one-head model) held a daemon's event loop for good.
MAX_TP_SIZE = 1024
MAX_PP_SIZE = 256


def check_parallel_sizes(field: str, tp_size: int, pp_size: int) -> None:
    """The one rule for an engine's TP and PP sizes, for its workers and for a peer's handshake."""
    if not 1 <= tp_size <= MAX_TP_SIZE:
        raise InvalidArgument(f"{field}tp_size", tp_size, f"must be in [1, {MAX_TP_SIZE}]")
    if not 1 <= pp_size <= MAX_PP_SIZE:
        raise InvalidArgument(f"{field}pp_size", pp_size, f"must be in [1, {MAX_PP_SIZE}]")


def check_request_id(field: str, value: str) -> str:
    """The one rule for request ids, on every call that carries one."""
    if not value or len(value) > MAX_REQUEST_ID:
        raise InvalidArgument(field, value, f"must be 1-{MAX_REQUEST_ID} characters")
    return value


def check_engine_id(field: str, value: str) -> str:
    """The one rule for engine ids, on every call that carries one."""
    if not value or len(value) > MAX_ENGINE_ID or not all(c.isascii() and (c.isalnum() or c in "-_.:") for c in value):
        raise InvalidArgument(field, value, f"must be 1-{MAX_ENGINE_ID} chars of [A-Za-z0-9-_.:]")
    return value


@dataclass(frozen=True)
class WorkerId:
    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        check_engine_id("worker.engine_id", self.engine_id)
        check_parallel_sizes("worker.", self.tp_size, self.pp_size)
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument("worker.tp_rank", self.tp_rank, f"must be in [0, tp_size={self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise InvalidArgument("worker.pp_rank", self.pp_rank, f"must be in [0, pp_size={self.pp_size})")

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.engine_id, self.tp_rank, self.pp_rank)

    def __str__(self) -> str:
        return f"{self.engine_id}[tp{self.tp_rank}/{self.tp_size},pp{self.pp_rank}/{self.pp_size}]"


def check_no_overlap(field: str, shape: Sequence[int], stride: Sequence[int]) -> None:
    """Refuse strides that give two elements one address: taken from the
    innermost, each dim must step past everything inside it (padding allowed)."""
    reach = 1
    for st, n in sorted((st, n) for n, st in zip(shape, stride, strict=True) if n > 1):
        if st < reach:
            raise InvalidArgument(field, list(stride), f"makes elements overlap: a stride of {st} inside a run of {reach} elements")
        reach = st * n


def physical_order(dims: Sequence[str], shape: Sequence[int], stride: Sequence[int]) -> tuple[str, ...]:
    """Dim names sorted outermost first by stride; size-1 dims keep their place."""
    order = sorted(range(len(dims)), key=lambda i: (-stride[i] if shape[i] > 1 else 0, i))
    # A stable sort on -stride puts size-1 dims (key 0) last; put them back
    # next to their shape position instead, so 'physical' stays readable.
    movable = [i for i in order if shape[i] > 1]
    fixed = {i for i in range(len(dims)) if shape[i] <= 1}
    result: list[int] = []
    it = iter(movable)
    for i in range(len(dims)):
        result.append(i if i in fixed else next(it))
    return tuple(dims[i] for i in result)


def infer_spec(
    dims: Sequence[str],
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: str,
    *,
    use_mla: bool = False,
    block_size: int = 0,
) -> KVCacheSpec:
    """Infer a spec from one tensor's shape and strides (vLLM registers tensors
    in logical NHD shape and expresses HND through a stride permutation)."""
    if len(dims) != len(shape) or len(shape) != len(stride):
        raise InvalidArgument("tensor.dims", list(dims), f"must name each of the {len(shape)} dims of shape {list(shape)}")
    sizes = dict(zip(dims, shape, strict=True))
    layout = physical_order(dims, shape, stride)
    opaque = "span" in sizes
    return KVCacheSpec(
        # An opaque span hides its tokens: the caller must say how many.
        block_size=block_size or int(sizes.get("token", 1 if not opaque else 0)),
        num_kv_heads=int(sizes.get("head", 1)),
        head_size=int(sizes.get("span", 1)) if opaque else int(sizes.get("dim", 1)),
        dtype=dtype,
        layout=layout,
        num_blocks=int(sizes["block"]) if "block" in sizes else 0,
        use_mla=use_mla,
        span_size=int(sizes["span"]) if opaque else 0,
    )
