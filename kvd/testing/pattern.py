"""A logical KV tensor with a distinct value per (request, layer, kv, token,
head, dim), for filling prefill caches and verifying decode caches.

Values are computed from *global* coordinates (global layer index, global
head, position of the token in the request), so a decode rank can verify its
blocks without knowing anything about the prefill engine's shape. Values are
bit patterns in the same-width integer dtype kvd moves, so they are exact for
every dtype, fp8 included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvd.core.relayout import GroupTensors, move_dtype
from kvd.core.topology import heads_of_rank

_P = (1_000_003, 7919, 104_729, 31, 131, 1)  # seed, layer, kv, token, head, dim


@dataclass(frozen=True)
class RankCoords:
    """Where a rank's local heads sit among the model's heads."""

    head_start: int  # global head of local head 0

    @classmethod
    def of(cls, tp_rank: int, tp_size: int, total_heads: int, use_mla: bool) -> RankCoords:
        return cls(heads_of_rank(tp_rank, tp_size, total_heads, use_mla).start)


def expected(
    seed: int,
    layers: Sequence[int],
    num_kv: int,
    nblocks: int,
    tokens_per_block: int,
    heads: int,
    head_start: int,
    dim: int,
    dtype: torch.dtype,
    first_token: int = 0,
) -> torch.Tensor:
    """(layer, kv, block, token, head, dim) values, as ``dtype`` bits; the
    first block holds the request's tokens from ``first_token`` on."""
    i64 = torch.int64
    layer = torch.tensor(list(layers), dtype=i64).view(-1, 1, 1, 1, 1, 1)
    kv = torch.arange(num_kv, dtype=i64).view(1, -1, 1, 1, 1, 1)
    tok = (first_token + torch.arange(nblocks, dtype=i64).view(-1, 1) * tokens_per_block + torch.arange(tokens_per_block, dtype=i64)).view(1, 1, nblocks, tokens_per_block, 1, 1)
    head = (torch.arange(heads, dtype=i64) + head_start).view(1, 1, 1, 1, -1, 1)
    d = torch.arange(dim, dtype=i64).view(1, 1, 1, 1, 1, -1)
    v = seed * _P[0] + layer * _P[1] + kv * _P[2] + tok * _P[3] + head * _P[4] + d * _P[5]
    bits = torch.iinfo(dtype).bits
    v = v & ((1 << bits) - 1)
    if dtype != torch.uint8:
        v = torch.where(v >= 1 << (bits - 1), v - (1 << bits), v)  # two's complement
    return v.to(dtype)


def _views(group: GroupTensors) -> list[tuple[int | None, list[tuple[int, torch.Tensor]]]]:
    out = []
    positions = tuple(range(len(group.layer_indices)))
    for p, kv in enumerate(group.kv_of_part):
        out.append((kv, [(i, view) for i, _c, view in group.layer_runs(p, positions)]))
    return out


def _expected_for(group: GroupTensors, seed: int, block_ids: Sequence[int], coords: RankCoords, first_token: int = 0,
                  layers: Sequence[int] | None = None) -> torch.Tensor:
    spec = group.spec
    tokens = 1 if spec.opaque else spec.block_size
    dim = spec.span_size if spec.opaque else spec.head_size
    return expected(
        seed, group.layer_indices if layers is None else layers, spec.num_kv, len(block_ids), tokens, spec.num_kv_heads, coords.head_start, dim,
        move_dtype(spec.dtype), first_token,
    )


def fill(group: GroupTensors, seed: int, block_ids: Sequence[int], coords: RankCoords, first_token: int = 0,
         positions: Sequence[int] | None = None) -> None:
    """Write the request's values into its blocks of every layer (only the
    group's layer ``positions``, when given: a layer computed at a time), the
    first block holding the tokens from ``first_token`` on."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    wanted = range(len(group.layer_indices)) if positions is None else positions
    for kv, runs in _views(group):
        for i, view in runs:
            for p in wanted:
                if i <= p < i + view.shape[0]:
                    # One layer at a time: a long request's values for every layer at once run to gigabytes.
                    exp = _expected_for(group, seed, block_ids, coords, first_token, [group.layer_indices[p]])
                    view[p - i, :, ids.to(view.device)] = (exp[0] if kv is None else exp[0, kv : kv + 1]).to(view.device)


def mismatch(group: GroupTensors, seed: int, block_ids: Sequence[int], coords: RankCoords, num_tokens: int, first_token: int = 0,
             valid_from: int = 0) -> str | None:
    """None when every valid token (``[valid_from, num_tokens)``) of every
    block matches; else the first difference. The first block holds the
    tokens from ``first_token`` on."""
    spec = group.spec
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    tokens = 1 if spec.opaque else spec.block_size
    position = first_token + torch.arange(len(block_ids)).view(-1, 1) * tokens + torch.arange(tokens)
    valid = (position < (num_tokens if not spec.opaque else len(block_ids))) & (position >= valid_from)
    for kv, runs in _views(group):
        for i, stacked in runs:
            # One layer at a time: a long request's expected values for every layer at once run to gigabytes.
            for j in range(stacked.shape[0]):
                exp = _expected_for(group, seed, block_ids, coords, first_token, [group.layer_indices[i + j]])
                got = stacked[j : j + 1, :, ids.to(stacked.device)].cpu()
                want = exp if kv is None else exp[:, kv : kv + 1]
                bad = (got != want) & valid.view(1, 1, *valid.shape, 1, 1)
                if bool(bad.any()):
                    idx = [int(x) for x in bad.nonzero()[0]]
                    layer = group.layer_indices[i + j]
                    return (
                        f"layer {layer} kv {idx[1] if kv is None else kv} block {block_ids[idx[2]]} token {idx[3]} "
                        f"head {idx[4]} dim {idx[5]}: got {int(got[tuple(idx)])} want {int(want[tuple(idx)])}"
                    )
    return None
