"""TP / PP / block-size ratios between a prefill and a decode engine (pure).

The vocabulary follows vLLM's ``TpKVTopology``: each rank of an engine with
``tp_size`` ranks holds a contiguous slice of the model's KV heads, or, when
``tp_size > total_num_kv_heads``, one head replicated over
``tp_size / total_num_kv_heads`` ranks. MLA caches hold one latent that every
rank replicates. A state part (Mamba, linear attention) splits over TP by
its own heads, not the model's KV heads, so its group gets read targets of
its own; a target names the groups it serves.

For one local (reading) rank, ``read_targets`` says which remote ranks to
read, which heads of each (in the remote rank's local head numbering) and
where they land (in the local rank's numbering), and which layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvd.core.errors import Incompatible


@dataclass(frozen=True)
class HeadSlice:
    """Global heads ``[start, start + count)`` held by one rank."""

    start: int
    count: int
    replicas: int  # ranks holding these very heads

    @property
    def stop(self) -> int:
        return self.start + self.count


def heads_of_rank(tp_rank: int, tp_size: int, total_heads: int, use_mla: bool) -> HeadSlice:
    if use_mla:
        return HeadSlice(0, 1, tp_size)
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise Incompatible("tp_size", tp_size, total_heads, "total_num_kv_heads must be divisible by tp_size")
        per = total_heads // tp_size
        return HeadSlice(tp_rank * per, per, 1)
    if tp_size % total_heads:
        raise Incompatible("tp_size", tp_size, total_heads, "tp_size must be a multiple of total_num_kv_heads when heads are replicated")
    rep = tp_size // total_heads
    return HeadSlice(tp_rank // rep, 1, rep)


@dataclass(frozen=True)
class EngineShape:
    """What topology needs of one engine."""

    tp_size: int
    pp_size: int
    total_num_kv_heads: int
    use_mla: bool
    layers_by_pp_rank: Mapping[int, frozenset[int]]  # global layer indices per PP stage
    state_groups: Mapping[int, StateSplit] = field(default_factory=dict)  # by group id
    # The layers attention groups hold. A layer may hold both (Falcon-H1 runs
    # attention and Mamba2 side by side in every layer). None: every layer
    # that no state group holds.
    attention_layers: frozenset[int] | None = None

    @property
    def state_layers(self) -> frozenset[int]:
        return frozenset().union(*(s.layers for s in self.state_groups.values()))

    def attention_layers_of(self, layers: frozenset[int]) -> frozenset[int]:
        """Those of ``layers`` that attention groups hold."""
        return layers & self.attention_layers if self.attention_layers is not None else layers - self.state_layers


@dataclass(frozen=True)
class StateSplit:
    """A state group as topology sees it: its heads over all TP ranks, and its layers."""

    total_heads: int
    layers: frozenset[int]


@dataclass(frozen=True)
class ReadTarget:
    remote_tp_rank: int
    remote_pp_rank: int
    remote_head_start: int  # in the remote rank's local head numbering
    head_count: int
    local_head_start: int  # in the local rank's local head numbering
    layers: tuple[int, ...]  # global layer indices, ascending
    groups: tuple[int, ...] | None = None  # the state groups these heads are of; None: the attention groups


def check_pairing(local: EngineShape, remote: EngineShape) -> None:
    """Refuse pairings that cannot work, naming both values."""
    if local.use_mla != remote.use_mla:
        raise Incompatible("use_mla", local.use_mla, remote.use_mla)
    if local.total_num_kv_heads != remote.total_num_kv_heads:
        raise Incompatible("total_num_kv_heads", local.total_num_kv_heads, remote.total_num_kv_heads)
    for g in sorted(set(local.state_groups) | set(remote.state_groups)):
        mine, theirs = local.state_groups.get(g), remote.state_groups.get(g)
        if (mine and mine.total_heads) != (theirs and theirs.total_heads):
            raise Incompatible(f"group[{g}].total_heads", mine and mine.total_heads, theirs and theirs.total_heads,
                               "a state part's heads over all TP ranks must match")
    for name, shape in (("local", local), ("remote", remote)):
        totals = [(shape.total_num_kv_heads, shape.use_mla)] if shape.total_num_kv_heads else []
        totals += [(s.total_heads, False) for s in shape.state_groups.values()]
        for total, mla in totals:
            for r in range(shape.tp_size):
                try:
                    heads_of_rank(r, shape.tp_size, total, mla)
                except Incompatible as e:
                    raise Incompatible(
                        "tp_size", local.tp_size, remote.tp_size, f"{name} engine: {e.message}"
                    ) from None
    remote_layers = frozenset().union(*remote.layers_by_pp_rank.values()) if remote.layers_by_pp_rank else frozenset()
    local_layers = frozenset().union(*local.layers_by_pp_rank.values()) if local.layers_by_pp_rank else frozenset()
    missing = sorted(local_layers - remote_layers)
    if missing:
        raise Incompatible("layers", sorted(local_layers), sorted(remote_layers), f"remote engine lacks layers {missing[:8]}")


def replica_primary(shape: EngineShape, tp_rank: int) -> int:
    """The lowest TP rank holding exactly the same heads as ``tp_rank``.

    With MLA every rank holds the one latent; with ``tp_size > heads`` each
    head is held by ``tp_size / heads`` consecutive ranks.
    """
    if shape.use_mla:
        return 0
    if shape.tp_size > shape.total_num_kv_heads:
        rep = shape.tp_size // shape.total_num_kv_heads
        return tp_rank // rep * rep
    return tp_rank


def fanout_source(shape: EngineShape, tp_rank: int, pp_rank: int, present: frozenset[tuple[int, int]]) -> int | None:
    """The local TP rank to copy from instead of reading remotely, or None.

    A replica that is not its group's primary copies from the primary when
    the primary's memory is on the same daemon (``present`` lists the
    (tp, pp) ranks there), so the engine reads each remote byte once.
    """
    if shape.state_groups:
        return None  # state parts split where attention heads replicate: a replica's state is its own
    primary = replica_primary(shape, tp_rank)
    if primary != tp_rank and (primary, pp_rank) in present:
        return primary
    return None


def read_targets(
    local: EngineShape, remote: EngineShape, local_tp_rank: int, local_pp_rank: int,
    present: frozenset[tuple[int, int]] = frozenset(),
) -> list[ReadTarget]:
    """The remote reads one local rank makes, heads first, then PP stages.

    Empty for a replica that copies from its primary (see ``fanout_source``).
    """
    check_pairing(local, remote)
    if fanout_source(local, local_tp_rank, local_pp_rank, present) is not None:
        return []
    wanted = local.layers_by_pp_rank.get(local_pp_rank, frozenset())
    targets: list[ReadTarget] = []
    if local.total_num_kv_heads:
        targets += _targets(local, remote, local_tp_rank, local.total_num_kv_heads, local.use_mla, local.attention_layers_of(wanted), None)
    for g, split in sorted(local.state_groups.items()):
        targets += _targets(local, remote, local_tp_rank, split.total_heads, False, wanted & split.layers, (g,))
    return targets


def _targets(local: EngineShape, remote: EngineShape, local_tp_rank: int, total: int, use_mla: bool,
             wanted_layers: frozenset[int], groups: tuple[int, ...] | None) -> list[ReadTarget]:
    """The reads of one head split (the attention heads, or one state group's)."""
    mine = heads_of_rank(local_tp_rank, local.tp_size, total, use_mla)
    targets: list[ReadTarget] = []
    for head_start, head_count, tp_rank in _head_sources(mine, local_tp_rank, remote.tp_size, total, use_mla):
        theirs = heads_of_rank(tp_rank, remote.tp_size, total, use_mla)
        for pp_rank in sorted(remote.layers_by_pp_rank):
            layers = tuple(sorted(wanted_layers & remote.layers_by_pp_rank[pp_rank]))
            if not layers:
                continue
            targets.append(
                ReadTarget(
                    remote_tp_rank=tp_rank,
                    remote_pp_rank=pp_rank,
                    remote_head_start=head_start - theirs.start,
                    head_count=head_count,
                    local_head_start=head_start - mine.start,
                    layers=layers,
                    groups=groups,
                )
            )
    return targets


def _head_sources(mine: HeadSlice, local_tp_rank: int, remote_tp: int, total: int, use_mla: bool) -> list[tuple[int, int, int]]:
    """(global head start, count, remote tp rank) covering ``mine`` exactly once."""
    if use_mla:
        # One latent, replicated on every remote rank: spread local ranks over them.
        return [(0, 1, local_tp_rank % remote_tp)]
    out: list[tuple[int, int, int]] = []
    h = mine.start
    while h < mine.stop:
        if remote_tp <= total:
            per = total // remote_tp
            tp_rank = h // per
            stop = min(mine.stop, (tp_rank + 1) * per)
        else:
            rep = remote_tp // total
            # Replicated remotely: local ranks sharing a head pick different replicas.
            tp_rank = h * rep + (local_tp_rank % rep)
            stop = h + 1
        out.append((h, stop - h, tp_rank))
        h = stop
    return out


def block_ratio(remote_block_size: int, local_block_size: int, *, opaque: bool) -> int:
    """How many small blocks make one big one; refuses what cannot be re-blocked."""
    if remote_block_size == local_block_size:
        return 1
    if opaque:
        raise Incompatible(
            "block_size", local_block_size, remote_block_size,
            "an opaque per-head span layout cannot be re-blocked",
        )
    big, small = max(remote_block_size, local_block_size), min(remote_block_size, local_block_size)
    if big % small:
        raise Incompatible("block_size", local_block_size, remote_block_size, "one block size must divide the other")
    return big // small


def layers_by_stage(layer_sets: Sequence[tuple[int, Sequence[int]]]) -> dict[int, frozenset[int]]:
    """Collect (pp_rank, layer indices) pairs into a stage map."""
    out: dict[int, set[int]] = {}
    for pp_rank, layers in layer_sets:
        out.setdefault(pp_rank, set()).update(layers)
    return {k: frozenset(v) for k, v in out.items()}
