"""KV-cache group kinds, and which of a prompt's tokens decode needs of each (pure).

vLLM's ``KVCacheConfig`` puts layers that attend alike in one group with one
block table: full attention (MLA included), sliding window, chunked local
attention. A pull loads a prompt's first ``N`` tokens and decode computes
position ``N`` next (kvd's vLLM connector loads all but the prompt's last
token, which decode computes for the logits), so of those ``N`` tokens:

* full attention needs every one;
* a sliding window of ``W`` needs ``[N - W + 1, N)``: position ``N`` attends
  to the ``W`` positions ending at itself, later positions to later ones
  (vLLM's ``get_num_skipped_tokens``, the same rule);
* chunked local attention of chunk ``C`` needs the chunk holding ``N``, from
  its start: nothing at all when ``N`` starts a chunk;
* a state part (Mamba's conv or SSM state, gated delta-net's) is no run of
  tokens: it needs the request's running state, the last block it lists,
  whole. Its "tokens" are the state's rows, the same on both sides.

Blocks are moved whole, so the first needed token is rounded down to the
reader's block boundary. Everything before it is what the group saves
against full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.core.errors import InvalidArgument

FULL, SLIDING_WINDOW, CHUNKED_LOCAL, STATE = "full", "sliding_window", "chunked_local", "state"
GROUP_KINDS = (FULL, SLIDING_WINDOW, CHUNKED_LOCAL, STATE)
WINDOWED = (SLIDING_WINDOW, CHUNKED_LOCAL)


@dataclass(frozen=True)
class GroupKind:
    """What a group's layers attend to. ``window`` is the sliding window or
    the chunk, in tokens; 0 for full attention."""

    name: str = FULL
    window: int = 0

    def __post_init__(self) -> None:
        if self.name not in GROUP_KINDS:
            raise InvalidArgument("group.kind", self.name, f"is not one of {list(GROUP_KINDS)}")
        if self.name not in WINDOWED and self.window:
            raise InvalidArgument("group.window_tokens", self.window, "is only for sliding_window and chunked_local groups")
        if self.name in WINDOWED and self.window <= 0:
            raise InvalidArgument("group.window_tokens", self.window, f"must be positive for a {self.name} group")

    @property
    def is_state(self) -> bool:
        return self.name == STATE

    def first_needed_token(self, num_tokens: int) -> int:
        """The first of ``num_tokens`` loaded tokens that decode reads
        (``num_tokens`` itself when it needs none of them)."""
        if self.name == SLIDING_WINDOW:
            return max(0, num_tokens - self.window + 1)
        if self.name == CHUNKED_LOCAL:
            return num_tokens // self.window * self.window
        return 0

    def first_needed_block_token(self, num_tokens: int, block_size: int) -> int:
        """``first_needed_token`` rounded down to a block of ``block_size``."""
        return self.first_needed_token(num_tokens) // block_size * block_size

    def __str__(self) -> str:
        return f"{self.name}({self.window})" if self.name in WINDOWED else self.name


FULL_ATTENTION = GroupKind()
STATE_PART = GroupKind(STATE)
