"""Finished sets per worker, and their merge per engine (pure).

Semantics follow vLLM's ``KVConnectorBase_V1.get_finished`` and
``KVOutputAggregator``: a worker reports request ids whose sends and receives
have ended; an engine-level aggregator emits a request once
``expected_finished_count`` workers (the world size by default) have reported
it; invalid block ids are unioned.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvd.core.errors import InvalidArgument
from kvd.core.spec import check_request_id


@dataclass(frozen=True)
class Outcome:
    request_id: str
    direction: str  # sending | recving
    outcome: str  # done | failed | expired | aborted
    reason: str = ""
    bytes: int = 0


DIRECTIONS = ("sending", "recving")
OUTCOMES = ("done", "failed", "expired", "aborted")


def check_outcomes(field: str, outcomes: Iterable[Outcome]) -> None:
    """Outcomes another daemon reports, by name: a request id by the one
    rule, a known direction and outcome (a made-up one would land in a
    finished set vLLM frees blocks by)."""
    for i, o in enumerate(outcomes):
        check_request_id(f"{field}[{i}].request_id", o.request_id)
        if o.direction not in DIRECTIONS:
            raise InvalidArgument(f"{field}[{i}].direction", o.direction, f"must be one of {', '.join(DIRECTIONS)}")
        if o.outcome not in OUTCOMES:
            raise InvalidArgument(f"{field}[{i}].outcome", o.outcome, f"must be one of {', '.join(OUTCOMES)}")


# A box nobody reads must not grow forever: an engine takes its sets per
# worker (vLLM) or per engine, rarely both, and the other box only fills.
# Past this many unread outcomes of one direction the oldest go.
MAX_UNREAD = 1 << 16


@dataclass
class WorkerFinished:
    """What one worker has not yet been told."""

    sending: dict[str, Outcome] = field(default_factory=dict)
    recving: dict[str, Outcome] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)
    # Woken after every add (a stream that pushes this box); not part of its value.
    watchers: list[Callable[[], None]] = field(default_factory=list, compare=False, repr=False)

    def add(self, outcome: Outcome, invalid_block_ids: Iterable[int] = ()) -> None:
        (self.sending if outcome.direction == "sending" else self.recving)[outcome.request_id] = outcome
        self.invalid_block_ids.update(invalid_block_ids)
        self.wake()

    def extend(self, later: WorkerFinished) -> None:
        """Append what ``later`` holds, as if added after this box's own outcomes."""
        for outcome in later.outcomes():
            self.add(outcome)
        self.invalid_block_ids |= later.invalid_block_ids
        self.wake()

    @property
    def empty(self) -> bool:
        """Nothing to tell: no outcome and no invalid block id."""
        return not (self.sending or self.recving or self.invalid_block_ids)

    def take(self, limit: int) -> WorkerFinished:
        """Move out the oldest ``limit`` outcomes (sending first) and every
        invalid id: one bounded report of a box that queued a lot."""
        out = WorkerFinished(invalid_block_ids=self.invalid_block_ids)
        self.invalid_block_ids = set()
        for box, into in ((self.sending, out.sending), (self.recving, out.recving)):
            # The oldest, listed once: popping the first key again and again
            # scans past every slot popped before it (quadratic in a full box).
            for rid in list(itertools.islice(box, limit - len(out.sending) - len(out.recving))):
                into[rid] = box.pop(rid)
        return out

    def outcomes(self) -> list[Outcome]:
        return [*self.sending.values(), *self.recving.values()]

    def wake(self) -> None:
        for watcher in list(self.watchers):
            watcher()

    def bound(self, limit: int = MAX_UNREAD) -> int:
        """Forget the oldest outcomes past ``limit`` a direction: nobody is
        reading this box. Returns how many went. Invalid block ids are never
        forgotten: a failed load whose outcome is still read without all of
        them would leave vLLM taking unwritten blocks for loaded, and they are
        bounded anyway, by the blocks the engine has."""
        dropped = 0
        for box in (self.sending, self.recving):
            for rid in list(itertools.islice(box, max(0, len(box) - limit))):  # dicts keep insertion order: the oldest first
                del box[rid]
                dropped += 1
        return dropped

    def drain(self) -> WorkerFinished:
        out = WorkerFinished(self.sending, self.recving, self.invalid_block_ids)
        self.sending, self.recving, self.invalid_block_ids = {}, {}, set()
        return out


class PushLog:
    """What one worker registration's WatchFinished streams pushed, numbered
    from 1. A stream can break with a push in flight: the worker reopens it
    naming the last number it got, and the daemon resends what followed. Only
    the newest stream pushes (``claim``), so a broken one the daemon has not
    noticed yet cannot drain outcomes into a dead connection."""

    def __init__(self, keep: int = 1024) -> None:
        self.last_seq = 0
        self.owner = 0  # the stream allowed to push
        self._kept: collections.deque[tuple[int, WorkerFinished]] = collections.deque(maxlen=keep)

    def claim(self) -> int:
        self.owner += 1
        return self.owner

    def push(self, sets: WorkerFinished) -> int:
        self.last_seq += 1
        self._kept.append((self.last_seq, sets))
        return self.last_seq

    def since(self, seq: int) -> list[tuple[int, WorkerFinished]] | None:
        """What was pushed after ``seq``; None when some of it is no longer kept
        (or ``seq`` was never pushed): the worker cannot be made whole."""
        if seq > self.last_seq or (seq < self.last_seq and self._kept[0][0] > seq + 1):
            return None
        return [(n, sets) for n, sets in self._kept if n > seq]


class KVOutputAggregator:
    """Merge per-worker finished sets into an engine's, like vLLM's aggregator."""

    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError("expected_finished_count must be >= 1")
        self.expected = expected_finished_count
        # (direction, request_id) -> (workers reported so far, worst outcome so far)
        self._pending: dict[tuple[str, str], tuple[int, Outcome]] = {}

    def aggregate(self, outputs: Iterable[WorkerFinished]) -> WorkerFinished:
        merged = WorkerFinished()
        for out in outputs:
            merged.invalid_block_ids |= out.invalid_block_ids
            for outcome in out.outcomes():
                key = (outcome.direction, outcome.request_id)
                count, worst = self._pending.get(key, (0, outcome))
                # One failed worker fails the request for the whole engine.
                if worst.outcome == "done" and outcome.outcome != "done":
                    worst = outcome
                count += 1
                if count >= self.expected:
                    self._pending.pop(key, None)
                    merged.add(worst)
                else:
                    self._pending[key] = (count, worst)
        return merged

    def set_expected(self, count: int) -> WorkerFinished:
        """Expect ``count`` workers per request from now on; what already has
        that many completes now (a lower count must not strand it: no
        further report of it may ever come)."""
        if count < 1:
            raise ValueError("expected_finished_count must be >= 1")
        self.expected = count
        merged = WorkerFinished()
        for key, (reported, worst) in list(self._pending.items()):
            if reported >= count:
                del self._pending[key]
                merged.add(worst)
        return merged


class EngineFinishedHub:
    """An engine's merged finished sets: drained by one call, or pushed to
    subscribers as requests complete. Pure: subscribers are plain callbacks."""

    def __init__(self, expected_finished_count: int = 1) -> None:
        self.aggregator = KVOutputAggregator(expected_finished_count)
        self.pending = WorkerFinished()
        self.subscribers: list[Callable[[WorkerFinished], None]] = []
        self.dropped = 0

    @property
    def expected(self) -> int:
        return self.aggregator.expected

    def set_expected(self, count: int) -> WorkerFinished:
        """Expect ``count`` workers per request; what that completes is delivered as by ``report``."""
        return self._deliver(self.aggregator.set_expected(count))

    def new_engine(self, count: int) -> None:
        """Another engine (another world size) registered: what the old one
        left half-reported is not the new one's, and is dropped, not completed."""
        self.aggregator = KVOutputAggregator(count)

    def report(self, output: WorkerFinished) -> WorkerFinished:
        """Merge one worker's outcomes; what completes goes to the
        subscribers, or, with none, waits for ``drain`` (bounded: see
        ``MAX_UNREAD``; ``dropped`` counts what a reader never took)."""
        return self._deliver(self.aggregator.aggregate([output]))

    def _deliver(self, merged: WorkerFinished) -> WorkerFinished:
        if not merged.empty:
            if self.subscribers:  # pushed: holding it too would keep it forever
                for notify in list(self.subscribers):
                    notify(merged)
            else:
                self.keep(merged)
        return merged

    def keep(self, sets: WorkerFinished) -> int:
        """Hold ``sets`` for ``drain`` (bounded); how many outcomes that dropped (also in ``dropped``)."""
        self.pending.extend(sets)
        dropped = self.pending.bound()
        self.dropped += dropped
        return dropped

    def drain(self) -> WorkerFinished:
        return self.pending.drain()

    def take(self, limit: int) -> WorkerFinished:
        """The oldest ``limit`` outcomes kept for ``drain`` (and every invalid id): one bounded answer."""
        return self.pending.take(limit)


class ReportLedger:
    """Which numbered reports from other daemons this aggregator applied.

    The aggregator counts reports per request, not per rank, as vLLM's
    ``KVOutputAggregator`` does, so a report applied twice counts its rank
    twice and can finish a request before every rank has. A sender numbers
    its reports within its epoch and sends them in order, one at a time,
    retrying the same report until it is answered: a report already applied
    (its answer lost to a timeout) comes again with the number it had, and
    anything at or below the last number applied is a repeat."""

    def __init__(self, max_senders: int = 4096) -> None:
        # The newest number applied per sender epoch; the oldest senders go
        # past ``max_senders`` (every restart of every daemon is a new one).
        self._last: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.max_senders = max_senders

    def applied(self, sender_epoch: str, seq: int) -> bool:
        """Was this report applied already? Unnumbered reports (seq 0: from
        a daemon that does not number them) never count as applied."""
        return seq != 0 and bool(sender_epoch) and seq <= self._last.get(sender_epoch, 0)

    def record(self, sender_epoch: str, seq: int) -> None:
        """This report is applied (recorded after it is, so one that failed
        halfway is applied when it comes again)."""
        if seq == 0 or not sender_epoch:
            return
        self._last[sender_epoch] = max(seq, self._last.get(sender_epoch, 0))
        self._last.move_to_end(sender_epoch)
        while len(self._last) > self.max_senders:
            self._last.popitem(last=False)
