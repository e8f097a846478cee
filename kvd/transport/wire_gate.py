"""The wire's gate: a read's thread waits here before each segment until
``core/qos.WireSchedule`` grants it the wire (``--qos on``).

A reader that stops receiving a segment stops its sender too (TCP's own
flow control), so ordering the reader's receives orders the wire: a bulk
read paused between segments leaves the wire to the interactive read that
arrived, and two tenants' reads alternate by their shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from kvd.core.qos import QosTag, QueueStatus, WireSchedule, peer_tag
from kvd.core.reads import DataRead
from kvd.transport.framing import always
from kvd.transport.thread_nice import base_nice, bulk_nice

_POLL_SECONDS = 0.05  # how often a waiting thread looks whether its read was abandoned
# The longest a chunk waits for the wire, and the longest a grant holds a
# place: a send blocked on a reader that stopped reading moves on only when
# the send times out (seconds), so past this its place stops counting
# (``WireSchedule.overdue``), and a chunk that still finds none moves anyway.
MAX_WAIT_SECONDS = 0.25


class WireGate:
    def __init__(self, schedule: WireSchedule, chunk_bytes: int,
                 on_grant: Callable[[QosTag, int, float], None] = lambda tag, nbytes, waited: None, max_wait_s: float = MAX_WAIT_SECONDS,
                 bulk_nice_increment: int = 0) -> None:
        self.schedule = schedule
        # The nice a thread moving a read of each lane runs at (thread_nice):
        # interactive at the daemon's own, the rest ``bulk_nice_increment`` above.
        self.normal_nice = base_nice()
        self.bulk_nice = bulk_nice(self.normal_nice, bulk_nice_increment)
        self.max_wait_s = max_wait_s
        self.chunk_bytes = chunk_bytes  # what a read moves between looks at the order
        self.on_grant = on_grant  # (tag, bytes, seconds waited): the metrics
        self._cond = threading.Condition()
        self._granted: set[object] = set()
        self._held_since: dict[object, float] = {}  # keys granted and not yet done: when granted
        self._bytes: dict[tuple[str, str], int] = {}  # moved, by (class, tenant)
        self.forced = 0  # chunks that waited past max_wait_s and moved anyway

    def wait(self, key: object, tag: QosTag, nbytes: int, cancel: threading.Event) -> None:
        """Block until ``key`` holds the wire (asked now, unless it asked
        when its last chunk was done); ``cancel`` drops it and raises."""
        t0 = time.perf_counter()
        with self._cond:
            if key not in self._granted and not self.schedule.queued(key) and not cancel.is_set():
                self._add(self.schedule.ask(key, tag, nbytes), t0)
            while key not in self._granted or cancel.is_set():
                if cancel.is_set():  # an abandoned read starts no chunk, granted or not
                    self._drop(key)
                    raise ConnectionAbortedError("read abandoned while it waited for the wire")
                now = time.perf_counter()
                if now - t0 > self.max_wait_s:
                    # The places are held by moves that do not end: those held past
                    # the bound stop counting, and if that frees none, go anyway.
                    self.forced += 1
                    self._add(self.schedule.overdue([k for k, t in self._held_since.items() if now - t > self.max_wait_s]), now)
                    if key not in self._granted:
                        self.schedule.force(key)
                        self._held_since[key] = now
                    break
                self._cond.wait(min(_POLL_SECONDS, self.max_wait_s))
            self._granted.discard(key)
            self._bytes[(tag.priority, tag.tenant)] = self._bytes.get((tag.priority, tag.tenant), 0) + nbytes
        self.on_grant(tag, nbytes, time.perf_counter() - t0)

    def release(self, key: object, again: int = 0) -> None:
        """``key``'s chunk moved; with ``again``, it asks for its next at once."""
        with self._cond:
            self._drop(key, again)

    def _drop(self, key: object, again: int = 0) -> None:
        """``release``, with the lock held."""
        self._granted.discard(key)
        self._held_since.pop(key, None)
        self._add(self.schedule.done(key, again), time.perf_counter())

    def _add(self, granted: list[object], now: float) -> None:
        if granted:
            self._granted.update(granted)
            self._held_since.update(dict.fromkeys(granted, now))
            self._cond.notify_all()

    def for_read(self, tag: QosTag, cancel: threading.Event | None = None) -> ReadGate:
        return ReadGate(self, tag, cancel if cancel is not None else threading.Event(), self.chunk_bytes)

    def for_peer(self, read: DataRead) -> ReadGate:
        """The owner's gate of a reader's READ, by the tag the reader sent."""
        return self.for_read(peer_tag(read.priority, read.tenant, read.deadline_ms, time.monotonic(), self.schedule.shares))

    def queues(self) -> list[QueueStatus]:
        with self._cond:
            return [dataclasses.replace(q, granted_bytes=self._bytes.get((q.priority, q.tenant), 0)) for q in self.schedule.queues()]


@dataclass(frozen=True)
class ReadGate:
    """One read's gate (``transport.base.Gate``): one place in the queue,
    asked again as each chunk is done while the next follows at once, given
    up while the read waits for prefill and by ``close``."""

    gate: WireGate
    tag: QosTag
    cancel: threading.Event
    chunk_bytes: int
    key: object = field(default_factory=object)

    @contextlib.contextmanager
    def __call__(self, nbytes: int, then: Callable[[], bool] = always) -> Iterator[None]:
        self.gate.wait(self.key, self.tag, nbytes, self.cancel)
        try:
            yield
        except BaseException:
            self.gate.release(self.key)  # the read ends here: its place goes now
            raise
        # ``then``: its next chunk follows at once, so it competes for the place
        # it leaves; a read about to wait for prefill asks again after.
        try:
            follows = then()
        except Exception:  # e.g. the publication ended: the read finds out as it goes on
            follows = False
        self.gate.release(self.key, again=self.chunk_bytes if follows else 0)

    def close(self) -> None:
        self.gate.release(self.key)


class Admission:
    """The reading side's order (``--qos on``): which of this daemon's reads
    of one peer gets a data connection next, by the same policy as the wire
    (interactive reads have connections of their own; tenants' shares are
    of the bytes their reads move; earliest deadline first). On the event
    loop; a read holds its connection until it is done."""

    def __init__(self, shares: dict[str, float], connections: int) -> None:
        self.schedule = WireSchedule(shares, connections)
        self._waiting: dict[object, asyncio.Future[None]] = {}

    @contextlib.asynccontextmanager
    async def connection(self, tag: QosTag, nbytes: int) -> AsyncIterator[None]:
        key = object()
        fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        self._wake(self.schedule.ask(key, tag, nbytes))
        try:
            await fut
        except BaseException:  # cancelled waiting, or granted as it was
            self._waiting.pop(key, None)
            self._wake(self.schedule.done(key))
            raise
        try:
            yield
        finally:
            self._wake(self.schedule.done(key))

    def _wake(self, granted: list[object]) -> None:
        for key in granted:
            fut = self._waiting.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
