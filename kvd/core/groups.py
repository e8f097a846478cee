"""KV-cache group kinds, and which of a prompt's tokens decode needs of each (pure).

vLLM's ``KVCacheConfig`` puts layers that attend alike in one group with one
block table: full attention (MLA included), sliding window, chunked local
attention. Decode computes from the last prompt token on (vLLM recomputes
position ``N - 1`` for its logits; kvd's connector loads ``N - 1`` tokens
and leaves that position to decode), so for a prompt of ``N`` tokens:

* full attention needs every token;
* a sliding window of ``W`` needs tokens ``[N - W, N)``: position ``N - 1``
  attends to the ``W`` positions ending at itself (vLLM's
  ``get_num_skipped_tokens``), and later positions to later ones;
* chunked local attention of chunk ``C`` needs the chunk holding ``N - 1``.

Blocks are moved whole, so the first needed token is rounded down to the
reader's block boundary. Everything before it is what the group saves
against full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.core.errors import InvalidArgument

FULL, SLIDING_WINDOW, CHUNKED_LOCAL = "full", "sliding_window", "chunked_local"
GROUP_KINDS = (FULL, SLIDING_WINDOW, CHUNKED_LOCAL)


@dataclass(frozen=True)
class GroupKind:
    """What a group's layers attend to. ``window`` is the sliding window or
    the chunk, in tokens; 0 for full attention."""

    name: str = FULL
    window: int = 0

    def __post_init__(self) -> None:
        if self.name not in GROUP_KINDS:
            raise InvalidArgument("group.kind", self.name, f"is not one of {list(GROUP_KINDS)}")
        if self.name == FULL and self.window:
            raise InvalidArgument("group.window_tokens", self.window, "is only for sliding_window and chunked_local groups")
        if self.name != FULL and self.window <= 0:
            raise InvalidArgument("group.window_tokens", self.window, f"must be positive for a {self.name} group")

    def first_needed_token(self, num_tokens: int) -> int:
        """The first of a ``num_tokens`` prompt's tokens that decode reads."""
        if self.name == SLIDING_WINDOW:
            return max(0, num_tokens - self.window)
        if self.name == CHUNKED_LOCAL:
            return (max(0, num_tokens - 1) // self.window) * self.window
        return 0

    def first_needed_block_token(self, num_tokens: int, block_size: int) -> int:
        """``first_needed_token`` rounded down to a block of ``block_size``."""
        return self.first_needed_token(num_tokens) // block_size * block_size

    def __str__(self) -> str:
        return self.name if self.name == FULL else f"{self.name}({self.window})"


FULL_ATTENTION = GroupKind()
