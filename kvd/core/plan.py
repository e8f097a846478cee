"""Block ids to coalesced extents, vectorised (pure).

Both sides' blocks are cut into *units* of ``B = min(remote, local block
size)`` tokens. A unit's address on one side is ``block_id * k + slot`` where
``k`` is that side's blocks-per-unit ratio, so a run of units that advances by
one on both sides is one contiguous transfer. Runs are then cut at the big
side's block boundaries so every extent is a rectangle: ``n`` big blocks of
``u`` units each on one side, ``n * u`` consecutive small blocks on the other.
The receiver copies each extent with one strided copy (see relayout.py).

Everything here is numpy over block-id arrays; nothing loops per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvd.core.errors import InvalidArgument


@dataclass(frozen=True)
class Extents:
    """Columnar extents; row i moves ``n[i] * u[i]`` units.

    On each side a row covers blocks ``[block, block + count)`` and, inside
    each, tokens ``[token, token + tokens)``: see ``side``.
    """

    unit_tokens: int  # B
    remote_block_size: int
    local_block_size: int
    remote_block: np.ndarray
    remote_unit: np.ndarray  # unit offset inside the first remote block
    local_block: np.ndarray
    local_unit: np.ndarray
    n: np.ndarray
    u: np.ndarray

    def __len__(self) -> int:
        return int(self.n.shape[0])

    def side(self, i: int, remote: bool) -> tuple[int, int, int, int]:
        """(block_start, block_count, token_start, token_count) of row i."""
        bs = self.remote_block_size if remote else self.local_block_size
        block = int((self.remote_block if remote else self.local_block)[i])
        unit = int((self.remote_unit if remote else self.local_unit)[i])
        n, u = int(self.n[i]), int(self.u[i])
        if bs == self.unit_tokens:  # small side: n*u whole blocks
            return block, n * u, 0, bs
        return block, n, unit * self.unit_tokens, u * self.unit_tokens

    @property
    def total_units(self) -> int:
        return int((self.n * self.u).sum())


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def plan_extents(
    remote_ids: np.ndarray | Sequence[int],
    remote_block_size: int,
    local_ids: np.ndarray | Sequence[int],
    local_block_size: int,
    num_tokens: int,
    *,
    max_units: int = 0,
    remote_first: int = 0,
    local_first: int = 0,
    start: int | None = None,
    label: str = "",
) -> Extents:
    """Coalesce a request's block ids into rectangular extents.

    Each side's ids hold the tokens from its ``*_first`` token on (a multiple
    of its block size); tokens ``[start, num_tokens)`` are moved, ``start``
    being ``local_first`` unless the group needs less (a sliding window).
    ``max_units`` (0 = unbounded) caps the units one extent moves, so the data
    plane can pipeline chunks of a bounded size. ``label`` (a group, ``[1]``)
    goes into error fields.
    """
    r_ids = np.asarray(remote_ids, dtype=np.int64)
    l_ids = np.asarray(local_ids, dtype=np.int64)
    start = local_first if start is None else start
    if num_tokens <= 0:
        raise InvalidArgument("num_tokens", num_tokens, "must be positive")
    big, small = max(remote_block_size, local_block_size), min(remote_block_size, local_block_size)
    if big % small:
        raise InvalidArgument("block_size", (remote_block_size, local_block_size), "one must divide the other")
    for name, first, bs in ((f"remote block_ids{label}.first_token", remote_first, remote_block_size),
                            (f"local block_ids{label}.first_token", local_first, local_block_size)):
        if first < 0 or first % bs:
            raise InvalidArgument(name, first, f"must be a multiple of the block size {bs}")
        if first > start:
            raise InvalidArgument(name, first, f"starts after token {start}, the first this transfer needs")
    if start % small or start >= num_tokens:
        raise InvalidArgument("start", start, f"must be a multiple of {small} below num_tokens={num_tokens}")
    need_r = blocks_needed(num_tokens - remote_first, remote_block_size)
    need_l = blocks_needed(num_tokens - local_first, local_block_size)
    if r_ids.shape[0] < need_r:
        raise InvalidArgument(f"remote block_ids{label}", len(r_ids), f"cover fewer than num_tokens={num_tokens} from token {remote_first} (need {need_r} blocks of {remote_block_size})")
    if l_ids.shape[0] < need_l:
        raise InvalidArgument(f"local block_ids{label}", len(l_ids), f"cover fewer than num_tokens={num_tokens} from token {local_first} (need {need_l} blocks of {local_block_size})")
    k_r, k_l = remote_block_size // small, local_block_size // small
    k = big // small
    units = blocks_needed(num_tokens - start, small)
    u_idx = np.arange(units, dtype=np.int64)
    # Each side's unit index counts from its own first token.
    r_u, l_u = u_idx + (start - remote_first) // small, u_idx + (start - local_first) // small
    r_block, r_slot = r_ids[r_u // k_r], r_u % k_r
    l_block, l_slot = l_ids[l_u // k_l], l_u % k_l
    r_addr, l_addr = r_block * k_r + r_slot, l_block * k_l + l_slot

    # Runs of units contiguous on both sides.
    # (Slices, not np.diff/np.append: their Python wrappers cost more than the
    # arithmetic on the few ids of a small request, which is planned per pull.)
    breaks = np.ones(units, dtype=bool)
    breaks[1:] = (r_addr[1:] - r_addr[:-1] != 1) | (l_addr[1:] - l_addr[:-1] != 1)
    run_start = np.flatnonzero(breaks)
    ends = np.empty_like(run_start)
    ends[:-1], ends[-1:] = run_start[1:], units
    run_len = ends - run_start

    # Cut each run at the big side's block boundaries: head, full middle, tail.
    big_addr = r_addr if k_r == k else l_addr
    head = np.minimum(run_len, (-big_addr[run_start]) % k)
    middle = ((run_len - head) // k) * k
    tail = run_len - head - middle
    starts = np.concatenate([run_start, run_start + head, run_start + head + middle])
    lens = np.concatenate([head, middle, tail])
    per_big = np.concatenate([head, np.full_like(middle, k), tail])
    keep = lens > 0
    starts, lens, per_big = starts[keep], lens[keep], per_big[keep]
    order = np.argsort(starts, kind="stable")
    starts, lens, per_big = starts[order], lens[order], per_big[order]
    n = lens // per_big
    u = per_big

    n_max = np.maximum(1, max_units // u) if max_units > 0 else n
    if max_units > 0 and (n > n_max).any():
        # Split rows over max_units into chunks of whole big blocks.
        chunks = -(-n // n_max)
        row = np.repeat(np.arange(len(n)), chunks)
        first = np.cumsum(chunks) - chunks
        j = np.arange(row.shape[0]) - first[row]
        n_chunk = np.minimum(n_max[row], n[row] - j * n_max[row])
        starts = starts[row] + j * n_max[row] * u[row]
        n, u = n_chunk, u[row]

    return Extents(
        unit_tokens=small,
        remote_block_size=remote_block_size,
        local_block_size=local_block_size,
        remote_block=r_block[starts],
        remote_unit=r_slot[starts],
        local_block=l_block[starts],
        local_unit=l_slot[starts],
        n=n.astype(np.int64),
        u=u.astype(np.int64),
    )
