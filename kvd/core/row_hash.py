"""How verification reads and hashes a row's bytes (pure; see digest.py).

A row is the ``head_size`` values of one (layer, K/V plane, token, head). Its
hash is multilinear: its bytes read as the widest words the row makes,
dotted with keys modulo 2^64 (one pass; every dtype exact, fp8 is bytes).
Rows are read either a few at a time (a sample: a gather of whole rows, a
memcpy each where the dim is innermost) or as whole blocks: each hashed
where it lies when a block is big and dense (no copy), else gathered a
cache-sized chunk at a time and hashed from cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is loaded only to digest: the requests here travel without it (kvd status stays light)
    import torch

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping modulo 2^64)."""
    return mix_in_place(x.astype(np.uint64, copy=True))


def mix_in_place(x: np.ndarray) -> np.ndarray:
    """``mix`` of a uint64 array, in its own memory (no temporaries for a large one)."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _mix_int(x: int) -> int:
    """``mix`` of one value, in Python ints (a key: no arrays for one number)."""
    mask = (1 << 64) - 1
    x &= mask
    x ^= x >> 30
    x = (x * int(_M1)) & mask
    x ^= x >> 27
    x = (x * int(_M2)) & mask
    return x ^ (x >> 31)


def key(seed: int, salt: int) -> np.uint64:
    return np.uint64(_mix_int(seed ^ (salt * 0x9E3779B97F4A7C15)))


def row_keys(seed: int, words: int) -> np.ndarray:
    """The multilinear hash's key per word: odd, so a change to any one word always changes the sum."""
    return mix(np.arange(words, dtype=np.uint64) ^ key(seed, 2)) | np.uint64(1)


Gather = tuple["torch.Tensor", "torch.Tensor | tuple[torch.Tensor, ...]"]


@dataclass(frozen=True, eq=False)  # a view: compared by identity
class RowView:
    """A tensor whose rows each start a whole row into memory (the dim
    innermost: any NHD or HND cache) as one (rows, dim) view, and how many
    rows one step of each of its other dims moves."""

    flat: torch.Tensor
    steps: tuple[int, ...]
    on_cpu: bool  # an index into a device's rows goes there


def row_view(t: torch.Tensor) -> RowView | None:
    """``t``'s rows as a ``RowView``; None where they are not so laid out."""
    import torch

    d, strides = t.shape[-1], t.stride()
    if (t.stride(-1) != 1 and d > 1) or any(s % d for s in strides[:-1]) or t.numel() == 0:
        return None
    span = sum((n - 1) * s for n, s in zip(t.shape[:-1], strides[:-1], strict=True)) // d + 1
    return RowView(torch.as_strided(t, (span, d), (d, 1)), tuple(s // d for s in strides[:-1]), t.device.type == "cpu")


def row_gather(t: torch.Tensor, at: tuple[np.ndarray, ...], rows: RowView | None = None) -> Gather:
    """How to read ``t[at]`` (index arrays that broadcast), rows of ``t``'s
    last dim: (a view, its index), for ``read_rows``. Where ``t`` has a
    ``RowView`` (``rows``, if made already), an index_select of rows (a
    memcpy each), not an element-wise gather."""
    import torch

    rows = rows or row_view(t)
    if rows is None:
        full = np.broadcast_arrays(*at)
        return t, tuple(torch.from_numpy(np.ascontiguousarray(i).reshape(-1)) for i in full)
    # The one-dimensional terms summed in place first, the broadcast ones (a
    # plane axis) last: every step in a cold cache costs tens of us.
    terms = sorted(zip(at, rows.steps, strict=True), key=lambda term: np.ndim(term[0]))
    row = np.asarray(terms[0][0] * terms[0][1])
    for i, step in terms[1:]:
        if np.broadcast_shapes(row.shape, np.shape(i)) == row.shape:
            row += i * step  # fits in ``row``: no new array
        else:
            row = row + i * step
    index = torch.from_numpy(np.ascontiguousarray(row, dtype=np.int64).reshape(-1))
    return rows.flat, index if rows.on_cpu else index.to(t.device)


def read_rows(gather: Gather) -> torch.Tensor:
    view, index = gather
    return view[index] if isinstance(index, tuple) else view.index_select(0, index)


def hash_rows(rows: torch.Tensor, keys: np.ndarray, word_dtype: torch.dtype) -> np.ndarray:
    """Each row's multilinear hash: its bytes as words, dotted with ``keys``
    (one pass, wrapping modulo 2^64). ``rows``: (n, head_size)."""
    import torch

    n = rows.shape[0]
    if not n:  # a layer the sample drew no row of
        return np.zeros(0, dtype=np.uint64)
    words = rows.contiguous().view(word_dtype)  # a row's bytes are a whole number of words
    if word_dtype != torch.int64:
        words = words.to(torch.int64)
    return np.asarray(words.cpu().numpy().view(np.uint64).dot(keys))  # a GPU cache's rows come to the host


_CHUNK_BYTES = 2 << 20  # small blocks are hashed a cache-sized chunk at a time: gathered, then read again from cache
# A block at least this big, dense in host memory, is hashed where it lies:
# a call per block (~15 us) costs less than copying it to a chunk would.
_IN_PLACE_BYTES = 256 << 10


def hash_blocks(plane: torch.Tensor, ids: np.ndarray, keys: np.ndarray, word_dtype: torch.dtype, scratch: list[torch.Tensor]) -> np.ndarray:
    """The hashes of every row of blocks ``ids`` (int64) of one plane ``(block, token, head, dim)``,
    in (block, token, head) order; ``scratch`` keeps the chunk's buffer for the next call
    (a fresh one costs its first touch)."""
    import torch

    per_block = plane[0].numel()
    block_bytes = per_block * plane.element_size()
    word = word_dtype.itemsize
    # In place only where each block starts on a whole word (a view as words needs it) and every id is one of the plane's.
    aligned = (plane.storage_offset() * plane.element_size()) % word == 0 and (plane.stride(0) * plane.element_size()) % word == 0
    in_place = plane.device.type == "cpu" and block_bytes >= _IN_PLACE_BYTES and aligned and (not len(ids) or ids.min() >= 0)
    order = _dense_order(plane[0]) if in_place else None
    if order is not None:
        return np.concatenate([_hash_block_in_place(plane[i], order, keys, word_dtype) for i in ids]) if len(ids) else np.zeros(0, np.uint64)
    chunk = max(1, _CHUNK_BYTES // max(block_bytes, 1))
    if not scratch or scratch[0].device != plane.device or scratch[0].numel() < chunk * block_bytes:
        scratch[:] = [torch.empty(chunk * block_bytes, dtype=torch.uint8, device=plane.device)]
    buf = scratch[0]
    index = torch.from_numpy(ids)
    out = []
    for at in range(0, len(index), chunk):
        take = index[at: at + chunk]
        part = buf[: len(take) * block_bytes].view(plane.dtype).view(len(take), *plane.shape[1:])
        torch.index_select(plane, 0, take.to(plane.device), out=part)
        out.append(hash_rows(part.view(-1, plane.shape[-1]), keys, word_dtype))
    return np.concatenate(out) if out else np.zeros(0, np.uint64)


def _dense_order(block: torch.Tensor) -> tuple[int, int] | None:
    """For a block ``(token, head, dim)`` whose elements fill its span with
    the dim innermost (NHD, or HND's heads outermost): its (token, head)
    dims outermost first, so that its rows in memory are a (rows, dim) view.
    None where it is not so laid out."""
    (nt, nh, d), (st, sh, sd) = block.shape, block.stride()
    if sd != 1 and d > 1:
        return None
    for outer, inner in ((0, 1), (1, 0)):
        sizes, strides = (nt, nh), (st, sh)
        if strides[inner] == d and strides[outer] == sizes[inner] * d:
            return outer, inner
    return None


def _hash_block_in_place(block: torch.Tensor, order: tuple[int, int], keys: np.ndarray, word_dtype: torch.dtype) -> np.ndarray:
    """One dense block's row hashes in (token, head) order, read where it lies."""
    nt, nh, d = block.shape
    hashed = hash_rows(block.permute(*order, 2).reshape(-1, d), keys, word_dtype)  # a view: the block is dense in this order
    return hashed if order == (0, 1) else np.ascontiguousarray(hashed.reshape(nh, nt).T).reshape(-1)

