"""An engine as its peers see it: each rank's caches, what its daemon serves,
the wire version, and the fingerprint that says whether two engines can
exchange KV at all (``pairing.py`` works out how).

The daemon builds its own from its registrations (``Registry.engine_meta``);
a peer's arrives in its handshake, and is checked as a worker's registration
is, since pairing walks its ranks.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvd.core.errors import InvalidArgument
from kvd.core.spec import GroupSpec, ModelInfo, check_parallel_sizes


@dataclass(frozen=True)
class EngineLayout:
    """Everything a peer needs to know about one rank's caches."""

    tp_rank: int
    pp_rank: int
    groups: tuple[GroupSpec, ...]


# A daemon that serves streaming publications: reads wait for each layer's save.
LAYER_STREAM = "layer-stream"
# An owner that ends a striped rank once each reader ACKed all of its own
# stripes (kvd 0.2.0 counted all ACKs against readers x the last read's).
PER_READER_ACKS = "per-reader-acks"

# The wire protocol (gRPC API and data plane) this daemon speaks. It goes up
# by one when a change would break a peer of the previous version; a daemon
# talks to peers one version either side of its own (rolling upgrades, one
# node at a time) and refuses the rest at the handshake, naming both.
# 1: kvd 0.1.0, which did not send it; 2: kvd 0.2.0.
WIRE_VERSION = 2


@dataclass(frozen=True)
class EngineMeta:
    """One engine as a peer sees it after the handshake."""

    engine_id: str
    epoch: str
    host_id: str
    data_address: str
    tp_size: int
    pp_size: int
    model: ModelInfo
    ranks: tuple[EngineLayout, ...] = field(default_factory=tuple)
    # What the engine's daemon can serve beyond plain pulls (LAYER_STREAM).
    features: tuple[str, ...] = ()
    kvd_version: str = ""  # "" from kvd 0.1.0
    wire_version: int = 1  # kvd 0.1.0 did not say: 1

    @functools.cached_property
    def _by_rank(self) -> dict[tuple[int, int], EngineLayout]:  # the owner asks per (tp, pp) of a reader engine's shape
        return {(r.tp_rank, r.pp_rank): r for r in self.ranks}

    def rank(self, tp_rank: int, pp_rank: int) -> EngineLayout | None:
        return self._by_rank.get((tp_rank, pp_rank))


# A daemon serves the ranks of one host: a peer's handshake listing more is not one.
MAX_RANKS_PER_DAEMON = 1024


def check_engine(meta: EngineMeta) -> EngineMeta:
    """A peer's engine, checked at the edge as a worker's registration is:
    pairing and the owner's count of expected readers walk its ranks."""
    check_parallel_sizes("engine.", meta.tp_size, meta.pp_size)
    if len(meta.ranks) > MAX_RANKS_PER_DAEMON:
        raise InvalidArgument("engine.ranks", f"<{len(meta.ranks)} ranks>", f"exceeds the {MAX_RANKS_PER_DAEMON} one daemon serves")
    seen: set[tuple[int, int]] = set()
    for r in meta.ranks:
        key = (r.tp_rank, r.pp_rank)
        if not (0 <= r.tp_rank < meta.tp_size and 0 <= r.pp_rank < meta.pp_size) or key in seen:
            raise InvalidArgument("engine.ranks", key, f"is not a rank of tp_size={meta.tp_size} x pp_size={meta.pp_size}, or is listed twice")
        seen.add(key)
    return meta


def fingerprint(model: ModelInfo, groups: Sequence[GroupSpec]) -> str:
    """Compatibility fingerprint: layers, heads, head size, dtype, MLA.

    Two engines whose fingerprints differ cannot exchange KV at all; the
    handshake compares the parts one by one to say which value differs.
    """
    h = hashlib.sha256()
    h.update(f"layers={model.num_layers};heads={model.total_num_kv_heads}".encode())
    for g in sorted(groups, key=lambda g: g.group_id):
        s = g.spec
        h.update(f";g{g.group_id}:hs={s.head_size},dt={s.dtype},mla={s.use_mla},op={s.opaque},sf={s.span_format},k={g.kind}".encode())
    return h.hexdigest()[:16]


def compat_fields(model: ModelInfo, groups: Sequence[GroupSpec]) -> Mapping[str, object]:
    """The fingerprint's inputs, by name, for error messages."""
    fields: dict[str, object] = {
        "num_layers": model.num_layers,
        "total_num_kv_heads": model.total_num_kv_heads,
        "num_groups": len(groups),
    }
    for g in sorted(groups, key=lambda g: g.group_id):
        s = g.spec
        fields[f"group[{g.group_id}].head_size"] = s.head_size
        fields[f"group[{g.group_id}].dtype"] = s.dtype
        fields[f"group[{g.group_id}].use_mla"] = s.use_mla
        fields[f"group[{g.group_id}].opaque"] = s.opaque
        # Groups that attend differently need different tokens: never paired.
        fields[f"group[{g.group_id}].kind"] = g.kind.name
        fields[f"group[{g.group_id}].window_tokens"] = g.kind.window
        if s.opaque:
            fields[f"group[{g.group_id}].span_size"] = s.span_size
            fields[f"group[{g.group_id}].span_format"] = s.span_format
    return fields
