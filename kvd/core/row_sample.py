"""Which rows a sampled digest reads (pure; see digest.py).

A sample is ``per_window`` rows of each aligned window of ``WINDOW`` token
positions, each a (layer, token, head) drawn by a hash of the window and
the request's seed: both sides pick the same rows from the seed alone,
whatever range, layers and heads each holds, and the engine whose bytes
are checked cannot know which rows count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvd.core.errors import InvalidArgument
from kvd.core.row_hash import key, mix, mix_in_place

WINDOW = 16  # sampled rows are drawn per aligned window of this many positions (and per layer)


@dataclass(frozen=True)
class RowSample:
    """Which rows to digest: every one (``per_window=0``), or ``per_window``
    rows of each aligned window of ``WINDOW`` positions, each a (layer,
    token, head) drawn by ``seed`` (with replacement: a row drawn twice
    counts twice on both sides). A systematic error is found within a few
    requests; a single changed row is found by ``full``."""

    seed: int
    per_window: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**64:
            raise InvalidArgument("verify.seed", self.seed, "must be an unsigned 64-bit integer")
        if not 0 <= self.per_window <= MAX_PER_WINDOW:
            raise InvalidArgument("verify.per_window", self.per_window, f"must be 0 (every row) to {MAX_PER_WINDOW}")

    def describe(self) -> str:
        return "every row" if self.per_window == 0 else f"{self.per_window} rows of every {WINDOW} tokens sampled"

    def rows(self, group_id: int, layers: Sequence[int], start: int, stop: int, heads: range, total_heads: int,
             total_layers: int, by_layer: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows to digest of ``layers`` (global indices) x tokens ``[start,
        stop)`` x global ``heads``, as (position in ``layers``, token, head),
        int64. Every row, layer by layer, each layer's in (token, head) order;
        or the sample's draws: ``per_window`` a window, each a (layer of
        ``total_layers``, token, head of ``total_heads``), kept where held,
        layer by layer where ``by_layer`` (else in the order drawn)."""
        nl, nt, nh = len(layers), max(stop - start, 0), len(heads)
        if self.per_window == 0:
            return (np.repeat(np.arange(nl, dtype=np.int64), nt * nh), np.tile(np.repeat(np.arange(start, start + nt, dtype=np.int64), nh), nl),
                    np.tile(np.arange(heads.start, heads.stop, dtype=np.int64), nl * nt))
        # Each step below costs tens of us in a cache a transfer left cold: as
        # few as the draw takes, and none where every row drawn is held.
        drawn, window_tokens = _draws(start // WINDOW, -(-stop // WINDOW), self.per_window)
        h = mix_in_place(drawn ^ (key(self.seed, 1) ^ np.uint64(group_id << 52)))
        # Each below 2^63: viewed as int64, not converted.
        tokens = window_tokens + (h & np.uint64(WINDOW - 1)).view(np.int64)
        head = ((h >> np.uint64(4)) % np.uint64(max(total_heads, 1))).view(np.int64)
        lpos = (mix(h) % np.uint64(max(total_layers, 1))).view(np.int64)
        keep = None
        if tuple(layers) != tuple(range(total_layers)):
            position = np.full(max(max(layers, default=0), total_layers) + 1, -1, dtype=np.int64)
            position[np.asarray(layers, dtype=np.int64)] = np.arange(nl)
            lpos = position[lpos]
            keep = lpos >= 0
        if start % WINDOW or stop % WINDOW:
            keep = both(keep, (tokens >= start) & (tokens < stop))
        if heads != range(total_heads):
            keep = both(keep, (head >= heads.start) & (head < heads.stop))
        if keep is not None:
            lpos, tokens, head = lpos[keep], tokens[keep], head[keep]
        if not by_layer:
            return lpos, tokens, head
        order = np.argsort(lpos, kind="stable")
        return lpos[order], tokens[order], head[order]


@functools.lru_cache(maxsize=64)
def _draws(first_window: int, stop_window: int, per_window: int) -> tuple[np.ndarray, np.ndarray]:
    """What a sample's draws over windows ``[first_window, stop_window)`` hash
    (window << 8 | draw), and each draw's window's first token: the same for
    every request of a length (read-only; one numpy step each is tens of us
    in a cache a transfer left cold)."""
    windows = np.arange(first_window, stop_window, dtype=np.int64)
    drawn = ((windows.view(np.uint64) << np.uint64(8)).reshape(-1, 1) | np.arange(per_window, dtype=np.uint64)).reshape(-1)
    window_tokens = np.repeat(windows * WINDOW, per_window)
    drawn.flags.writeable = window_tokens.flags.writeable = False
    return drawn, window_tokens


def both(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    return b if a is None else a & b


MAX_PER_WINDOW = 255  # a window's draws pack into 8 bits of the hash's input
