"""A digest of KV rows that no layout, block size, TP split or PP stage changes (pure).

Verification (issue 46) asks whether D's cache, read in D's own layout,
holds what P computed. Both sides digest the same *logical rows*: one row is
the ``head_size`` values of one (group, layer, K/V plane, token, head), named
by global coordinates (the token's position in the request, the model's head
number), so the two sides agree on every row without agreeing on memory.

A row's digest is a keyed multilinear hash of its values (their bit patterns
as integers, so every dtype is exact and fp8 is bytes), mixed with the row's
name. ``RowDigests`` keeps them per (layer, token, head), K and V summed
modulo 2^64; sums commute, so any reader's question -- these layers, these
heads, binned by its own block size -- is answered by adding, over as many
ranks as hold the rows, with no rank talking to another. A reader's
mismatch then names its own layer and block.

Rows are every token's (full) or a seeded sample: exactly ``per_window``
tokens of every aligned 16 positions, chosen by a hash of the position and
the seed, so both sides pick the same tokens from the seed alone and every
reader block of 16 tokens or more is checked. The seed is the daemon's,
drawn when it takes the digest, so the engine whose bytes are checked
cannot know which rows count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvd.core.errors import InvalidArgument, KvdError

if TYPE_CHECKING:  # torch is loaded only to digest: the requests here travel without it (kvd status stays light)
    from kvd.core.relayout import GroupTensors

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
# A row's name packs into 64 bits: token 32, head 11, kv 1, layer 12, group 8.
_LIMITS = {"group": 1 << 8, "layer": 1 << 12, "head": 1 << 11, "token": 1 << 32}


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping modulo 2^64)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _key(seed: int, salt: int) -> np.uint64:
    return np.uint64(mix(np.array([(seed ^ (salt * 0x9E3779B97F4A7C15)) & (2**64 - 1)], dtype=np.uint64))[0])


WINDOW = 16  # sampled tokens are chosen within each aligned window of this many positions


@dataclass(frozen=True)
class RowSample:
    """Which tokens' rows to digest: every one (``per_window=0``), or exactly
    ``per_window`` tokens of each aligned window of ``WINDOW`` positions,
    chosen by ``seed``. Exactly, not about: every reader block of 16 tokens
    or more holds sampled rows, whatever its size and wherever a range ends."""

    seed: int
    per_window: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**64:
            raise InvalidArgument("verify.seed", self.seed, "must be an unsigned 64-bit integer")
        if not 0 <= self.per_window < WINDOW:
            raise InvalidArgument("verify.per_window", self.per_window, f"must be 0 (every row) to {WINDOW - 1}")

    def describe(self) -> str:
        return "every row" if self.per_window == 0 else f"{self.per_window} tokens of every {WINDOW} sampled"

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """The sampled positions in ``[start, stop)``, ascending: a token's
        place among its whole window's hashes decides, so the choice is the
        same for any range that holds it."""
        if self.per_window == 0 or stop <= start:
            return np.arange(start, stop, dtype=np.int64)
        lo, hi = start // WINDOW * WINDOW, -(-stop // WINDOW) * WINDOW
        t = np.arange(lo, hi, dtype=np.int64).reshape(-1, WINDOW)
        rank = np.argsort(np.argsort(mix(t.astype(np.uint64) ^ _key(self.seed, 1)), axis=1), axis=1)
        picked = t[rank < self.per_window]
        return np.sort(picked[(picked >= start) & (picked < stop)])


@dataclass(frozen=True)
class RowDigests:
    """One rank's row digests of one group: ``values[layer, token, head]``
    (K and V summed) for ``layers`` x ``tokens`` x heads from ``head_start``."""

    layers: tuple[int, ...]  # global layer indices
    tokens: np.ndarray  # sampled positions, ascending
    head_start: int  # global head of the last axis's 0
    values: np.ndarray  # uint64 (layers, tokens, heads)

    @classmethod
    def of(cls, group: GroupTensors, group_id: int, block_ids: Sequence[int], first_token: int, num_tokens: int,
           head_start: int, sample: RowSample) -> RowDigests:
        """Digest the rows of tokens ``[first_token, num_tokens)`` held in
        ``block_ids`` (the first holding ``first_token``), local head ``h``
        being global head ``head_start + h``."""
        import torch

        spec = group.spec
        bs = spec.block_size
        if spec.opaque:
            raise InvalidArgument("verify", "opaque", "an opaque span hides its tokens: its rows cannot be digested")
        if first_token % bs:
            raise InvalidArgument("first_token", first_token, f"must be a multiple of the block size {bs}")
        for name, value in (("group", group_id), ("layer", max(group.layer_indices, default=0)),
                            ("head", head_start + spec.num_kv_heads - 1), ("token", num_tokens - 1)):
            if value >= _LIMITS[name]:
                raise InvalidArgument(f"verify.{name}", value, f"is past what a row's name holds ({_LIMITS[name] - 1})")
        if spec.state:
            sample = RowSample(sample.seed)  # a state part is a few rows a block: every one counts (both sides apply this)
        tokens = sample.tokens(first_token, min(num_tokens, first_token + len(block_ids) * bs))
        values = np.zeros((len(group.layer_indices), len(tokens), spec.num_kv_heads), dtype=np.uint64)
        if len(tokens):
            rel = torch.from_numpy(tokens - first_token)
            blocks, slots = torch.as_tensor(list(block_ids), dtype=torch.int64)[rel // bs], rel % bs
            # A row hashed as the widest words its bytes make (8 bytes: no widening, 4x fewer products than bf16 elements).
            row_bytes = spec.head_size * spec.itemsize
            word = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)
            word_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
            elem_keys = mix(np.arange(row_bytes // word, dtype=np.uint64) ^ _key(sample.seed, 2)) | np.uint64(1)
            seed_key = _key(sample.seed, 3)
            heads = np.arange(head_start, head_start + spec.num_kv_heads, dtype=np.uint64).reshape(1, 1, -1)
            names = tokens.astype(np.uint64).reshape(1, -1, 1) | (heads << np.uint64(32)) | (np.uint64(group_id) << np.uint64(56))
            for part, view in enumerate(group.parts):
                kv_of_part = group.kv_of_part[part]
                for li, layer in enumerate(group.layer_indices):
                    v = view[li] if isinstance(view, torch.Tensor) else view[li][0]  # (kv, block, token, head, dim)
                    gathered = v[:, blocks, slots]  # (kv, tokens, heads, dim), a new tensor
                    words = gathered.reshape(-1).view(torch.uint8).view(word_dtype).reshape(*gathered.shape[:3], -1)  # one flat view: a size-1 dim's stride is free
                    rows = words.to(torch.int64).cpu().numpy().view(np.uint64)  # (kv, tokens, heads, words); a GPU cache's sampled rows come to the host
                    hashed = (rows * elem_keys).sum(axis=-1, dtype=np.uint64)
                    planes = [kv_of_part] if kv_of_part is not None else range(rows.shape[0])
                    kv = np.asarray(planes, dtype=np.uint64).reshape(-1, 1, 1)
                    named = names | (np.uint64(layer) << np.uint64(44)) | (kv << np.uint64(43))
                    values[li] += mix(hashed ^ mix(named ^ seed_key)).sum(axis=0, dtype=np.uint64)
        return cls(tuple(group.layer_indices), tokens, head_start, values)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.tokens.nbytes

    def bins(self, layers: Sequence[int], heads: range, start: int, stop: int, bin_tokens: int) -> np.ndarray:
        """Sums per (layer of ``layers``, bin of ``bin_tokens`` positions) over
        ``heads`` (global) and tokens in ``[start, stop)``, as uint64
        ``(len(layers), ceil(stop / bin_tokens))``: 0 where this rank holds none.
        Add such arrays over ranks that hold disjoint rows."""
        out = np.zeros((len(layers), -(-stop // bin_tokens)), dtype=np.uint64)
        lo, hi = max(heads.start - self.head_start, 0), min(heads.stop - self.head_start, self.values.shape[2])
        keep = (self.tokens >= start) & (self.tokens < stop)
        if lo >= hi or not keep.any():
            return out
        tokens = self.tokens[keep]
        starts = np.flatnonzero(np.r_[True, np.diff(tokens // bin_tokens) != 0])
        at = tokens[starts] // bin_tokens
        index = {layer: i for i, layer in enumerate(self.layers)}
        for i, layer in enumerate(layers):
            if layer in index:
                per_token = self.values[index[layer]][keep, lo:hi].sum(axis=1, dtype=np.uint64)
                out[i, at] = np.add.reduceat(per_token, starts, dtype=np.uint64)
        return out


@dataclass(frozen=True)
class Mismatch:
    """Where a reader's digest differs: its blocks (bins), and the first layer and bin that differ."""

    bins: tuple[int, ...]
    first_layer: int
    first_bin: int


def compare(layers: Sequence[int], mine: np.ndarray, theirs: np.ndarray) -> Mismatch | None:
    """Compare per-(layer, bin) sums of both sides (from ``RowDigests.bins``, summed over ranks)."""
    if mine.shape != theirs.shape:
        raise InvalidArgument("verify.digests", list(theirs.shape), f"must be (layers, bins) {list(mine.shape)}")
    differ = mine != theirs
    if not differ.any():
        return None
    li, b = np.argwhere(differ.T)[0][::-1]  # the first bin, then its first layer
    return Mismatch(tuple(np.flatnonzero(differ.any(axis=0)).tolist()), int(layers[li]), int(b))


@dataclass(frozen=True)
class DigestRows:
    """What a reader asks of one group: sums per (layer, bin) over these rows."""

    group_id: int
    layers: tuple[int, ...]
    heads: range  # global
    token_start: int
    token_stop: int
    bin_tokens: int

    def __post_init__(self) -> None:
        if self.bin_tokens <= 0:
            raise InvalidArgument("rows.bin_tokens", self.bin_tokens, "must be positive")
        if not 0 <= self.token_start <= self.token_stop:
            raise InvalidArgument("rows.token_start", self.token_start, f"must be in [0, token_stop={self.token_stop}]")
        if self.heads.start > self.heads.stop:
            raise InvalidArgument("rows.head_start", self.heads.start, f"must be at most head_stop={self.heads.stop}")

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.layers), -(-self.token_stop // self.bin_tokens)


@dataclass(frozen=True)
class DigestQuery:
    """A reader's Peer.Digest: the publication, and the rows of each group it read."""

    engine_id: str
    request_id: str
    generation: int
    capability: bytes
    rows: tuple[DigestRows, ...]


@dataclass(frozen=True)
class DigestAnswer:
    """The owner's sample and its per-(layer, bin) sums, one array per asked group."""

    sample: RowSample
    sums: tuple[np.ndarray, ...]  # uint64, DigestRows.shape each


def answer(query: DigestQuery, sample: RowSample, held: Sequence[Sequence[RowDigests | None]]) -> DigestAnswer | None:
    """Sum the owner's ranks' digests for each asked group, each (layer,
    global head) once: a replica's heads count on the first rank that holds
    them. ``held``: per rank, its digests by group id (None: not digested).
    None unless every asked (layer, head) is held: a partial sum is no answer."""
    sums = []
    for rows in query.rows:
        total = np.zeros(rows.shape, dtype=np.uint64)
        counted: set[tuple[int, int]] = set()
        for groups in held:
            digests = groups[rows.group_id] if rows.group_id < len(groups) else None
            if digests is None:
                continue
            mine = range(max(rows.heads.start, digests.head_start), min(rows.heads.stop, digests.head_start + digests.values.shape[2]))
            for i, layer in enumerate(rows.layers):
                fresh = [h for h in mine if (layer, h) not in counted] if layer in digests.layers else []
                counted.update((layer, h) for h in fresh)
                for run in _runs(fresh):
                    total[i] += digests.bins((layer,), run, rows.token_start, rows.token_stop, rows.bin_tokens)[0]
        if len(counted) != len(rows.layers) * len(rows.heads):
            return None
        sums.append(total)
    return DigestAnswer(sample, tuple(sums))


def _runs(heads: Sequence[int]) -> list[range]:
    """Ascending ``heads`` as contiguous ranges."""
    out: list[range] = []
    for h in heads:
        if out and out[-1].stop == h:
            out[-1] = range(out[-1].start, h + 1)
        else:
            out.append(range(h, h + 1))
    return out


class VerifyMismatch(KvdError):
    """What landed is not what the owner published: these local blocks are wrong."""

    def __init__(self, message: str, invalid: Sequence[int]) -> None:
        super().__init__(message)
        self.invalid = sorted(set(invalid))
