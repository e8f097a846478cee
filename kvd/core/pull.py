"""One decode pull across its attempts, as state (pure).

The daemon shell plans a pull (``kvd.core.transfer.plan_pull``), hands the
reads to ``PullProgress.begin`` and runs those it returns; transports mark
segments landed as they land. After each attempt ``settle`` records which
reads landed whole, so that a retry reads only the rest (the owner ended the
ranks it acknowledged), and ``invalid_blocks`` says exactly which local
blocks some unlanded segment would have written. ``RetryPolicy`` decides
whether and when a failed attempt is tried again.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvd.core.engine_meta import PER_READER_ACKS
from kvd.core.reads import MAX_STRIPES, DataSegment
from kvd.core.transfer import RankRead, stripe

ReadKey = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class Striping:
    """A read of one remote rank of at least ``min_bytes`` goes over
    ``stripes`` connections at once, unless it is a same-host copy; with
    ``max_bytes``, in as many more reads as keep each within it (up to
    ``MAX_STRIPES``). A read holds its connection until it is done, so the
    reader's order of reads (``--qos on``) is kept at that grain: tenants'
    shares of 256 MiB reads were off by up to 15% over seconds."""

    stripes: int = 1
    min_bytes: int = 0
    max_bytes: int = 0

    def of(self, rr: RankRead) -> int:
        """How many reads ``rr`` is cut into."""
        n = self.stripes if rr.nbytes >= self.min_bytes else 1
        if self.max_bytes:
            n = max(n, -(-rr.nbytes // self.max_bytes))
        return min(n, MAX_STRIPES)

    def for_owner(self, features: Collection[str]) -> Striping:
        """As reads of an owner with ``features`` are cut: by ``max_bytes``
        only where it counts each reader's ACKs against that reader's own
        stripes (``PER_READER_ACKS``). How many reads a cap makes depends on
        each reader's bytes, so readers of one rank differ; an older owner
        could end that rank a stripe early (the pull failed and vLLM
        recomputed), and gets whole stripes as before the cap."""
        return self if PER_READER_ACKS in features or not self.max_bytes else replace(self, max_bytes=0)


@dataclass
class PullProgress:
    """What of one pull has landed, across attempts."""

    reads: list[RankRead] = field(default_factory=list)  # the current attempt's plan
    landed: list[list[bool]] = field(default_factory=list)  # per read, per segment
    # Reads that landed whole: their bytes, and the segments they were (a retry's
    # plan can cut a rank otherwise, when the peer became mapped here or stopped
    # being: the same key then covers other blocks, and is read again).
    done: dict[ReadKey, tuple[int, tuple[DataSegment, ...]]] = field(default_factory=dict)
    # (remote rank, head slice) whose every read landed: whole under any cut
    # (the owner may have ended it, and would refuse a read of it again).
    whole: set[tuple[int, int, int]] = field(default_factory=set)
    # The cut, kept for every attempt: the owner counts a reader's ACKs of a
    # rank against the stripes it first saw, so a retry that cut a rank
    # otherwise would end it early (a read still to come refused) or never
    # (held to its lease's end). The first attempt's segment size stands, and a
    # rank with some reads landed stays off the same-host path (unstriped).
    segment_bytes: int = 0
    local: frozenset[tuple[int, int]] = frozenset()  # the ranks this attempt reads same-host
    # Where the pull is (queued, resolve, handshake, plan, data, copy, verify): a pull
    # that fails says where it stopped, and how much had landed.
    phase: str = "queued"

    def begin(self, reads: Sequence[RankRead], striping: Striping, local_ranks: frozenset[tuple[int, int]] = frozenset(),
              segment_bytes: int = 0) -> list[int]:
        """Take an attempt's plan (made with ``segment_bytes``, kept from the
        first such attempt on: ``cut``); the indices of the reads still to run.
        Until an attempt plans, what the last one landed stands (a retry that
        fails before planning still reports exactly what did not land)."""
        self.segment_bytes = self.segment_bytes or segment_bytes
        begun = {key[:2] for key in self.done}
        self.local = frozenset(r for r in local_ranks if r not in begun or any(w[:2] == r for w in self.whole))
        self.reads = [part for rr in reads for part in (stripe(rr, striping.of(rr)) if rr.read.rank not in self.local else [rr])]
        done = [self._done(rr) for rr in self.reads]
        self.landed = [[d] * len(rr.sinks) for d, rr in zip(done, self.reads, strict=True)]
        return [i for i, d in enumerate(done) if not d]

    def cut(self, segment_bytes: int) -> int:
        """The segment size to plan with: that of the first attempt that began
        its reads (``begin``), else ``segment_bytes``."""
        return self.segment_bytes or segment_bytes

    def _done(self, rr: RankRead) -> bool:
        key = rr.read.key
        if key[:3] in self.whole:
            return True
        landed = self.done.get(key)
        return landed is not None and landed[1] == rr.read.segments

    def bytes_planned(self, todo: Sequence[int]) -> int:
        return sum(self.reads[i].nbytes for i in todo)

    def settle(self, ran: Sequence[int]) -> list[int]:
        """After an attempt: the reads of ``ran`` that landed whole, now
        remembered. A read counts once every segment landed, even if its task
        was cancelled after its ACK (were the ACK lost, the owner's lease ends
        the rank instead)."""
        newly = [i for i in ran if all(self.landed[i]) and not self._done(self.reads[i])]
        for i in newly:
            self.done[self.reads[i].read.key] = (self.reads[i].nbytes, self.reads[i].read.segments)
        if newly:
            parts: dict[tuple[int, int, int], bool] = {}
            for rr in self.reads:
                parts[rr.read.key[:3]] = parts.get(rr.read.key[:3], True) and self._done(rr)
            self.whole |= {part for part, done in parts.items() if done}
        return newly

    @property
    def moved(self) -> int:
        """Bytes of the current plan that landed, in any attempt."""
        return sum(rr.nbytes for rr in self.reads if self._done(rr))

    def landed_bytes(self) -> tuple[int, int]:
        """(Bytes landed, bytes planned) of the current plan, segment by segment."""
        landed = sum(sink.nbytes for rr, marks in zip(self.reads, self.landed, strict=True) for sink, ok in zip(rr.sinks, marks, strict=True) if ok)
        return landed, sum(rr.nbytes for rr in self.reads)

    def where(self) -> str:
        """Where a failed pull stopped, for its reason: the phase, and what had landed."""
        landed, planned = self.landed_bytes()
        return f"in phase {self.phase}, {landed} of {planned} bytes landed" if self.reads else f"in phase {self.phase}, nothing planned yet"

    def invalid_blocks(self, all_local: Sequence[int]) -> list[int]:
        """Exactly the local blocks some unlanded segment would have written
        (every block, before anything was planned)."""
        if not self.reads:
            return sorted(all_local)
        bad: set[int] = set()
        for rr, landed in zip(self.reads, self.landed, strict=True):
            for sink, ok in zip(rr.sinks, landed, strict=True):
                if not ok:
                    bad.update(int(b) for b in np.asarray(sink.local_block_ids))
        return sorted(bad)


@dataclass(frozen=True)
class RetryPolicy:
    """Transient failures (a reset connection, a restarted peer) are retried
    ``retries`` times with exponential backoff, capped at ``max_delay_s``."""

    retries: int = 2
    base_delay_s: float = 0.05
    max_delay_s: float = 1.0

    def delay(self, attempt: int, transient: bool) -> float | None:
        """Seconds to wait before the next attempt, or None to give up."""
        if not transient or attempt >= self.retries:
            return None
        return min(self.max_delay_s, self.base_delay_s * 2**attempt)
