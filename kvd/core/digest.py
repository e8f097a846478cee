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

Rows are every one (full) or a seeded sample: ``per_window`` rows of each
aligned window of 16 positions, each a (layer, token, head) drawn by a hash
of the window and the seed, so both sides pick the same rows from the seed
alone, whatever range, layers and heads they hold. A few rows a block, not
a share of its bytes: their cost is a cache miss each, whatever the model. A row's bytes are
read once as 8-byte words and summed against keys by one ``dot``; its name
enters through one mix. The seed is the daemon's, drawn when it takes the
digest, so the engine whose bytes are checked cannot know which rows count.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvd.core.errors import InvalidArgument, KvdError
from kvd.core.row_hash import (
    Gather,
    hash_blocks,
    hash_rows,
    key,
    mix,
    mix_in_place,
    read_rows,
    row_gather,
    row_keys,
    row_view,
)
from kvd.core.row_sample import RowSample, both

if TYPE_CHECKING:  # torch is loaded only to digest: the requests here travel without it (kvd status stays light)
    import torch

    from kvd.core.relayout import GroupTensors

# A row's name packs into 64 bits: token 32, head 11, kv 1, layer 12, group 8.
_LIMITS = {"group": 1 << 8, "layer": 1 << 12, "head": 1 << 11, "token": 1 << 32}




def _layer(view: torch.Tensor | list[torch.Tensor], li: int) -> torch.Tensor:
    """One layer's (kv, block, token, head, dim) view of a part, layers stacked or not."""
    return view[li] if not isinstance(view, list) else view[li][0]


@dataclass(frozen=True, eq=False)  # arrays and views: compared by identity
class RowPlan:
    """All of a digest (``RowDigests.of``) but reading the bytes: which rows,
    their names, keys and where they lie. A reader makes it while its bytes
    are on the way, so that what is left once they land is a gather, a hash
    and a sum (a cold cache makes each step of numpy cost tens of us). Every
    row (full) is planned as a grid, its names made a layer at a time as the
    blocks are hashed: nothing a row is held through the transfer."""

    group: GroupTensors
    group_id: int
    layers: tuple[int, ...]
    lpos: np.ndarray  # sampled: int64, into ``layers``; then tokens and global heads (full: empty)
    tokens: np.ndarray
    heads: np.ndarray
    ids: np.ndarray  # int64, the blocks (full: hashed whole)
    keys: np.ndarray  # the multilinear hash's, per word of a row
    word_dtype: torch.dtype
    name_key: np.uint64  # mixed into every row's name
    plane_keys: list[np.ndarray]  # per part, per plane: K and V each add their own
    named: list[np.ndarray]  # sampled, per part: each row's name, mixed, with its planes' keys: (planes, rows)
    gathers: list[list[Gather]]  # sampled, per part: the rows to read, plane-major
    every_row: bool  # full: blocks are hashed whole, not gathered row by row
    first_token: int
    stop: int
    head_start: int
    num_heads: int

    @classmethod
    def of(cls, group: GroupTensors, group_id: int, block_ids: Sequence[int], first_token: int, num_tokens: int,
           head_start: int, sample: RowSample, total_heads: int = 0, total_layers: int = 0) -> RowPlan:
        """As ``RowDigests.of``, which takes these arguments."""
        import torch

        spec = group.spec
        bs, nh = spec.block_size, spec.num_kv_heads
        if spec.opaque:
            raise InvalidArgument("verify", "opaque", "an opaque span hides its tokens: its rows cannot be digested")
        if first_token % bs:
            raise InvalidArgument("first_token", first_token, f"must be a multiple of the block size {bs}")
        for name, at_most in (("group", group_id), ("layer", max(group.layer_indices, default=0)),
                            ("head", head_start + nh - 1), ("token", num_tokens - 1)):
            if at_most >= _LIMITS[name]:
                raise InvalidArgument(f"verify.{name}", at_most, f"is past what a row's name holds ({_LIMITS[name] - 1})")
        if spec.state:
            sample = RowSample(sample.seed)  # a state part is a few rows a block: every one counts (both sides apply this)
        elif sample.per_window and total_heads < head_start + nh:
            raise InvalidArgument("verify.total_heads", total_heads, f"must hold this rank's heads [{head_start}, {head_start + nh})")
        elif sample.per_window and total_layers < 1:
            raise InvalidArgument("verify.total_layers", total_layers, "must be the model's layer count, at least 1")
        stop = min(num_tokens, first_token + len(block_ids) * bs)
        ids_np = np.asarray(block_ids, dtype=np.int64)
        row_bytes = spec.head_size * spec.itemsize
        word = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)  # the widest words a row makes: 8 bytes needs no widening
        word_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        layers = group.layer_indices
        plane_keys = []
        for part, view in enumerate(group.parts):
            planes = (view if isinstance(view, torch.Tensor) else view[0]).shape[1]
            kind = group.kv_of_part[part]  # a K-only or V-only part's plane, else each plane its own
            plane_keys.append(np.array([key(sample.seed, 4 + (kind if kind is not None else p)) for p in range(planes)], dtype=np.uint64))
        empty = np.zeros(0, dtype=np.int64)
        layer_by_layer = any(isinstance(v, list) for v in group.parts)  # its gathers need the rows in layer order
        lpos, tokens, heads = (empty, empty, empty) if sample.per_window == 0 else sample.rows(
            group_id, layers, first_token, stop, range(head_start, head_start + nh), total_heads, total_layers, by_layer=layer_by_layer)
        named: list[np.ndarray] = []
        gathers: list[list[Gather]] = []
        if len(tokens):
            # A row's name: token | head << 32 | layer << 44 | group << 56 (tokens and heads are
            # non-negative int64: viewed as uint64, not converted); the layer and group bits a group's own.
            name_bits = group.cached(("name-bits", group_id), lambda: _read_only(
                np.asarray(layers, dtype=np.uint64) << np.uint64(44) | np.uint64(group_id) << np.uint64(56)))
            names = tokens.view(np.uint64) | heads.view(np.uint64) << np.uint64(32)
            names |= name_bits[lpos]
            names ^= key(sample.seed, 3)
            once = mix_in_place(names)  # once a row: K and V add a key of their plane's
            block, slot = np.divmod(tokens - first_token, bs)
            at = (lpos, ids_np[block], slot, heads - head_start)
            bounds = np.searchsorted(lpos, np.arange(len(layers) + 1)) if layer_by_layer else None
            for part, (view, keys) in enumerate(zip(group.parts, plane_keys, strict=True)):
                named.append(once ^ keys.reshape(-1, 1))
                if isinstance(view, torch.Tensor):  # a few rows of every layer and plane: one gather
                    rows = group.cached(("row-view", part), functools.partial(row_view, view))
                    gathers.append([row_gather(view, (at[0], np.arange(len(keys)).reshape(-1, 1), *at[1:]), rows)])
                else:  # rows come layer by layer
                    assert bounds is not None
                    gathers.append([row_gather(_layer(view, li)[p], tuple(i[lo:hi] for i in at[1:]))
                                    for p in range(len(keys)) for li, (lo, hi) in enumerate(itertools.pairwise(bounds))])
        return cls(group, group_id, tuple(layers), lpos, tokens, heads, ids_np, row_keys(sample.seed, row_bytes // word), word_dtype,
                   key(sample.seed, 3), plane_keys, named, gathers, sample.per_window == 0, first_token, stop, head_start, nh)

    def digest(self) -> RowDigests:
        """Read the planned rows and digest them."""
        if self.every_row:
            return self._digest_every_row()
        value: np.ndarray | None = None
        for named, gathers in zip(self.named, self.gathers, strict=True):  # none where no row was drawn
            each = [hash_rows(read_rows(g), self.keys, self.word_dtype) for g in gathers]
            hashed = (each[0] if len(each) == 1 else np.concatenate(each)).reshape(named.shape[0], -1)
            hashed ^= named
            part = mix_in_place(hashed).sum(axis=0, dtype=np.uint64)
            value = part if value is None else value + part
        # Kept to the lease's end and past it: 32 bytes a sampled row (a few a block), the
        # plan's own arrays (each step costs tens of us in a cold cache: none to narrow them).
        return RowDigests(self.layers, self.lpos, self.tokens, self.heads, value if value is not None else np.zeros(0, dtype=np.uint64),
                          head_start=self.head_start, num_heads=self.num_heads, span=(self.first_token, self.stop))

    def _digest_every_row(self) -> RowDigests:
        """Every row, a layer at a time: each plane's rows are a slice of its
        blocks' hashes, in (token, head) order, as the names are made."""
        nt, nh = max(self.stop - self.first_token, 0), self.num_heads
        per_layer = nt * nh
        values = np.zeros(len(self.layers) * per_layer, dtype=np.uint64)
        tokens = np.arange(self.first_token, self.first_token + nt, dtype=np.uint64).reshape(-1, 1)
        base = (tokens | np.arange(self.head_start, self.head_start + nh, dtype=np.uint64) << np.uint64(32)
                | np.uint64(self.group_id) << np.uint64(56)).reshape(-1) ^ self.name_key
        scratch: list[torch.Tensor] = []
        for li, layer in enumerate(self.layers if per_layer else ()):
            once = mix(base ^ (np.uint64(layer) << np.uint64(44)))  # the layer's bits lie where the name's others are 0
            out = values[li * per_layer:(li + 1) * per_layer]
            for view, keys in zip(self.group.parts, self.plane_keys, strict=True):
                for p, plane_key in enumerate(keys):
                    hashed = hash_blocks(_layer(view, li)[p], self.ids, self.keys, self.word_dtype, scratch)[:per_layer]
                    hashed ^= once
                    hashed ^= plane_key
                    out += mix_in_place(hashed)
        # Kept to the lease's end and past it: 8 bytes a row (128k tokens x 32 layers x 8 heads: 0.25 GB).
        return RowDigests(self.layers, _NONE16, _NONE32, _NONE16, values, self.head_start, nh, grid=(self.first_token, nt))


_NONE16, _NONE32 = np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.uint32)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class RowDigests:
    """One rank's row digests of one group: ``values[i]`` (K and V summed) of
    the row (``layers[layer_pos[i]]``, ``tokens[i]``, global ``heads[i]``);
    or, with ``grid`` (first token, tokens), of every row: ``values`` is
    (layer, token, head) dense and the row arrays are empty.
    ``head_start`` and ``num_heads``: the global heads this rank holds."""

    layers: tuple[int, ...]  # global layer indices
    layer_pos: np.ndarray  # integers, into ``layers``
    tokens: np.ndarray  # integers
    heads: np.ndarray  # integers, global
    values: np.ndarray  # uint64
    head_start: int
    num_heads: int
    grid: tuple[int, int] | None = None
    span: tuple[int, int] | None = None  # sampled: every row's token lies in [first, stop)

    @classmethod
    def of(cls, group: GroupTensors, group_id: int, block_ids: Sequence[int], first_token: int, num_tokens: int,
           head_start: int, sample: RowSample, total_heads: int = 0, total_layers: int = 0) -> RowDigests:
        """Digest the rows of tokens ``[first_token, num_tokens)`` held in
        ``block_ids`` (the first holding ``first_token``), local head ``h``
        being global head ``head_start + h`` of the group's ``total_heads``,
        of a model of ``total_layers`` (a sample draws from both)."""
        return RowPlan.of(group, group_id, block_ids, first_token, num_tokens, head_start, sample, total_heads, total_layers).digest()

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.tokens.nbytes + self.heads.nbytes + self.layer_pos.nbytes

    def bins(self, layers: Sequence[int], heads: range, start: int, stop: int, bin_tokens: int) -> np.ndarray:
        """Sums per (layer of ``layers``, bin of ``bin_tokens`` positions) over
        ``heads`` (global) and tokens in ``[start, stop)``, as uint64
        ``(len(layers), ceil(stop / bin_tokens))``: 0 where this rank holds none.
        Add such arrays over ranks that hold disjoint rows."""
        nbins = -(-stop // bin_tokens)
        if self.grid is not None:
            return self._grid_bins(layers, heads, start, stop, bin_tokens, nbins)
        out = np.zeros(len(layers) * nbins, dtype=np.uint64)
        keep = None  # a reader asks of every row it drew: nothing to filter, no step
        if self.span is None or start > self.span[0] or stop < self.span[1]:
            keep = (self.tokens >= start) & (self.tokens < stop)
        if tuple(layers) == self.layers:  # a reader asks of its own layers (each step costs tens of us in a cold cache)
            row = self.layer_pos.astype(np.int64, copy=False)
        else:
            asked = np.full(len(self.layers) + 1, -1, dtype=np.int64)  # this rank's layer position -> row of ``out``
            where = {layer: i for i, layer in enumerate(layers)}
            asked[:-1] = [where.get(layer, -1) for layer in self.layers]
            row = asked[self.layer_pos]
            keep = both(keep, row >= 0)
        if heads.start > self.head_start or heads.stop < self.head_start + self.num_heads:
            keep = both(keep, (self.heads >= heads.start) & (self.heads < heads.stop))
        held = slice(None) if keep is None else keep  # every row, as views: no copy
        np.add.at(out, row[held] * nbins + self.tokens[held] // bin_tokens, self.values[held])
        return out.reshape(len(layers), nbins)

    def _grid_bins(self, layers: Sequence[int], heads: range, start: int, stop: int, bin_tokens: int, nbins: int) -> np.ndarray:
        """``bins`` of every row: sums of slices of the grid, no row by row."""
        assert self.grid is not None
        first, nt = self.grid
        out = np.zeros((len(layers), nbins), dtype=np.uint64)
        lo, hi = max(heads.start, self.head_start) - self.head_start, min(heads.stop, self.head_start + self.num_heads) - self.head_start
        a, b = max(start, first), min(stop, first + nt)
        held = [(i, self.layers.index(layer)) for i, layer in enumerate(layers) if layer in self.layers]
        if hi <= lo or b <= a or not held:
            return out
        grid = self.values.reshape(len(self.layers), nt, self.num_heads)
        rows = [j for _, j in held]
        if rows != list(range(len(self.layers))):
            grid = grid[rows]  # a copy, of the layers asked only
        # A bin's sum is a run of (token, head) values: with every head, a run of the row itself.
        picked = grid[:, a - first:b - first, lo:hi]
        flat = picked.reshape(len(held), -1) if hi - lo == self.num_heads else picked.sum(axis=2, dtype=np.uint64)
        first_bin, last_bin = a // bin_tokens, -(-b // bin_tokens)
        starts = (np.maximum(np.arange(first_bin, last_bin) * bin_tokens, a) - a) * (flat.shape[1] // (b - a))
        out[[i for i, _ in held], first_bin:last_bin] = np.add.reduceat(flat, starts, axis=1, dtype=np.uint64)
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
            mine = range(max(rows.heads.start, digests.head_start), min(rows.heads.stop, digests.head_start + digests.num_heads))
            by_runs: dict[tuple[range, ...], list[int]] = {}  # the layers whose uncounted heads are these runs: one sum each
            for i, layer in enumerate(rows.layers):
                fresh = [h for h in mine if (layer, h) not in counted] if layer in digests.layers else []
                counted.update((layer, h) for h in fresh)
                by_runs.setdefault(tuple(_runs(fresh)), []).append(i)
            for runs, at in by_runs.items():
                for run in runs:
                    total[at] += digests.bins([rows.layers[i] for i in at], run, rows.token_start, rows.token_stop, rows.bin_tokens)
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
