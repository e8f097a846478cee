"""Whether two engines can exchange KV, decided from their metadata alone.

The handshake runs ``check_compatible`` on both sides; a pair that cannot
work is refused with an ``Incompatible`` error naming the field and both
values. ``engine_shape`` is what topology needs of an engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.core.engine_meta import EngineMeta, compat_fields
from kvd.core.errors import Incompatible
from kvd.core.spec import GroupSpec
from kvd.core.topology import EngineShape, StateSplit, block_ratio, check_pairing, layers_by_stage

# Shapes of the metas seen last, by identity: a meta is immutable, and a
# daemon keeps each one (its own until a worker registers, a peer's until it
# handshakes again), so every pull would otherwise derive the same shape again.
_SHAPES: dict[int, tuple[EngineMeta, EngineShape]] = {}
_SHAPES_KEPT = 64


def engine_shape(meta: EngineMeta) -> EngineShape:
    hit = _SHAPES.get(id(meta))
    if hit is not None and hit[0] is meta:
        return hit[1]
    shape = _engine_shape(meta)
    if len(_SHAPES) >= _SHAPES_KEPT:
        _SHAPES.clear()  # one call, safe beside a plan in another thread (a big pull's)
    _SHAPES[id(meta)] = (meta, shape)  # the meta is kept with it: its id is not reused while cached
    return shape


def _engine_shape(meta: EngineMeta) -> EngineShape:
    use_mla = any(g.spec.use_mla for r in meta.ranks for g in r.groups)
    stages = layers_by_stage([(r.pp_rank, [idx for g in r.groups for idx in g.layer_indices]) for r in meta.ranks])
    # A state part splits over TP by its own heads: each rank holds an equal
    # share, or one head replicated on several ranks (``total_heads``).
    state: dict[int, StateSplit] = {}
    for r in meta.ranks:
        for g in r.groups:
            if g.spec.state:
                prev = state.get(g.group_id)
                layers = frozenset(g.layer_indices) | (prev.layers if prev else frozenset())
                state[g.group_id] = StateSplit(g.spec.heads_over_tp(meta.tp_size, meta.model.total_num_kv_heads), layers)
    attention = frozenset(idx for r in meta.ranks for g in r.groups if not g.spec.state for idx in g.layer_indices)
    return EngineShape(meta.tp_size, meta.pp_size, meta.model.total_num_kv_heads, use_mla, stages, state, attention)


def in_wire_order(local: Sequence[GroupSpec], remote: EngineMeta) -> bool:
    """Whether every local group already has the order its remote group's
    bytes cross the wire in: the same layout, parts, block size and heads per
    rank. Then a read over TCP is received in place and nothing is relaid out."""
    theirs = {g.group_id: g.spec for r in remote.ranks[:1] for g in r.groups}
    for g in local:
        ls, rs = g.spec, theirs.get(g.group_id)
        if rs is None or ls.state or (ls.layout, ls.parts_per_layer, ls.block_size, ls.num_kv_heads) != (rs.layout, rs.parts_per_layer, rs.block_size, rs.num_kv_heads):
            return False
    return bool(local)


def check_group_pairing(local: GroupSpec, remote: GroupSpec) -> int:
    """Refuse group pairs whose bytes cannot be converted; returns the block ratio."""
    ls, rs = local.spec, remote.spec
    gid = local.group_id
    if ls.dtype != rs.dtype:
        raise Incompatible(f"group[{gid}].dtype", ls.dtype, rs.dtype, "kvd does not convert dtypes")
    if ls.use_mla != rs.use_mla:
        raise Incompatible(f"group[{gid}].use_mla", ls.use_mla, rs.use_mla)
    if ls.opaque != rs.opaque:
        raise Incompatible(f"group[{gid}].layout", list(ls.layout), list(rs.layout), "an opaque span converts only to an opaque span")
    if ls.state and ls.block_size != rs.block_size:
        raise Incompatible(f"group[{gid}].block_size", ls.block_size, rs.block_size, "a state part's rows are its shape, not tokens: they must match")
    ratio = block_ratio(rs.block_size, ls.block_size, opaque=ls.opaque)
    if ls.opaque and ls.span_size != rs.span_size:
        raise Incompatible(f"group[{gid}].span_size", ls.span_size, rs.span_size)
    if ls.opaque and ls.span_format != rs.span_format:
        raise Incompatible(f"group[{gid}].span_format", ls.span_format, rs.span_format, "spans written by different kernels hold their bytes in different places")
    if not ls.opaque and ls.head_size != rs.head_size:
        raise Incompatible(f"group[{gid}].head_size", ls.head_size, rs.head_size)
    return ratio


def check_wire(mine: EngineMeta, theirs: EngineMeta) -> None:
    """Refuse a peer whose wire protocol is more than one version from ours, naming both."""
    if abs(mine.wire_version - theirs.wire_version) > 1:
        raise Incompatible("wire_version", f"{mine.wire_version} (kvd {mine.kvd_version or '0.1.0'})",
                           f"{theirs.wire_version} (kvd {theirs.kvd_version or '0.1.0'})",
                           f"engines {mine.engine_id!r} and {theirs.engine_id!r}: a daemon talks to daemons one wire version either side of "
                           "its own; upgrade one release at a time")


def check_compatible(mine: EngineMeta, theirs: EngineMeta) -> None:
    """Refuse a peer whose KV cannot mean the same thing, naming both values."""
    check_wire(mine, theirs)
    a = compat_fields(mine.model, mine.ranks[0].groups if mine.ranks else ())
    b = compat_fields(theirs.model, theirs.ranks[0].groups if theirs.ranks else ())
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            raise Incompatible(k, a.get(k), b.get(k), f"engines {mine.engine_id!r} and {theirs.engine_id!r} cannot exchange KV")
    check_pairing(engine_shape(mine), engine_shape(theirs))
    # Every group must convert: block-size ratio, head size, layout kind.
    if mine.ranks and theirs.ranks:
        for g in mine.ranks[0].groups:
            other = next((x for x in theirs.ranks[0].groups if x.group_id == g.group_id), None)
            if other is None:
                raise Incompatible(f"group[{g.group_id}]", "present", "absent")
            check_group_pairing(g, other)
