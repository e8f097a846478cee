"""Which waiting chunk of a read moves next: priority classes, deadlines
and tenants' shares of the wire (pure: time is passed in).

Many pulls share a daemon's connections and copy threads. Without an order,
a 4 GiB read holds the wire while a 4 MiB read a user waits on queues
behind it. Here every chunk (a segment of a read) asks for the wire before
it moves and says when it is done; ``WireSchedule`` answers with the chunks
that may move now:

* **Classes.** ``interactive`` has a lane of its own, and while any of its
  chunks waits or moves no new ``standard`` or ``background`` chunk starts
  (those already moving finish, a segment at most); ``standard`` goes
  before ``background``. A lower class still gets one grant in every
  ``FLOOR`` while it waits, so no class starves.
* **Tenants.** Within a class, the tenant that has had the least of the
  wire for its share goes next (start-time fair queuing over bytes): two
  backlogged tenants with shares 3 and 1 move 3:1 of the bytes, and a
  tenant with a small share still moves, slowly.
* **Deadlines.** Within a tenant and class, the earliest deadline first
  (EDF); without one, in the order asked.

The shell blocks a chunk's thread until it is granted (``daemon/wire_gate``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from kvd.core.errors import InvalidArgument

CLASSES = ("interactive", "standard", "background")  # highest first
DEFAULT_CLASS = "standard"
DEFAULT_TENANT = ""
FLOOR = 8  # a waiting lower class gets at least one grant in this many
MAX_DEADLINE_MS = 24 * 3600 * 1000.0


@dataclass(frozen=True)
class QosTag:
    """What a pull asks of the wire: its class, its tenant and its deadline (absolute, on the shell's clock)."""

    priority: str = DEFAULT_CLASS
    tenant: str = DEFAULT_TENANT
    deadline: float = float("inf")

    @classmethod
    def of(cls, priority: str, tenant: str, deadline_ms: float, now: float, shares: Mapping[str, float]) -> QosTag:
        """Check a pull's fields (naming the field and value on error); ``deadline_ms`` 0: none."""
        priority = priority or DEFAULT_CLASS
        if priority not in CLASSES:
            raise InvalidArgument("priority", priority, f"must be one of {', '.join(CLASSES)}")
        if not 0 <= deadline_ms <= MAX_DEADLINE_MS or deadline_ms != deadline_ms:
            raise InvalidArgument("deadline_ms", deadline_ms, f"must be in [0, {MAX_DEADLINE_MS:g}] (0: no deadline)")
        if tenant and tenant not in shares:
            known = ", ".join(sorted(t for t in shares if t)) or "none"
            raise InvalidArgument("tenant", tenant, f"is not a configured tenant (this daemon's: {known})")
        return cls(priority, tenant, now + deadline_ms / 1e3 if deadline_ms else float("inf"))


def peer_tag(priority: str, tenant: str, deadline_ms: float, now: float, shares: Mapping[str, float]) -> QosTag:
    """A reader's tag as its owner takes it: never refused (the reader
    checked it), a class or tenant unknown here taken as the default."""
    return QosTag(priority if priority in CLASSES else DEFAULT_CLASS, tenant if tenant in shares else DEFAULT_TENANT,
                  now + deadline_ms / 1e3 if 0 < deadline_ms <= MAX_DEADLINE_MS else float("inf"))


def ms_left(tag: QosTag, now: float) -> float:
    """A tag's deadline as ms from ``now`` for a peer (0: none; one already past: as soon as can be)."""
    return 0.0 if tag.deadline == float("inf") else max((tag.deadline - now) * 1e3, 1e-3)


def parse_shares(text: str) -> dict[str, float]:
    """``"gold=3,silver=1"`` as tenant shares; the unnamed tenant has share 1 unless named."""
    shares = {DEFAULT_TENANT: 1.0}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not sep or not name or not share > 0:
            raise InvalidArgument("tenants", item, "must be name=share with a share > 0 (as in gold=3,silver=1)")
        shares[name] = share
    return shares


@dataclass
class _Tenant:
    share: float
    start: float = 0.0  # virtual time of its next grant: bytes had / share
    waiting: list[tuple[float, int, Hashable]] = field(default_factory=list)  # (deadline, order asked, key), a heap
    moving: int = 0  # its chunks granted and not yet done (overdue ones too)


@dataclass(frozen=True)
class QueueStatus:
    priority: str
    tenant: str
    waiting: int
    moving: int  # holding the wire: moving a chunk, or about to
    granted_bytes: int = 0  # counted by the shell, which knows what each chunk moved


class WireSchedule:
    """Grants chunks the wire. ``ask`` and ``done`` return the keys granted by that event, in grant order."""

    def __init__(self, shares: Mapping[str, float], slots: int = 2) -> None:
        self.shares = dict(shares) or {DEFAULT_TENANT: 1.0}
        self.slots = slots
        self._lanes: dict[str, dict[str, _Tenant]] = {c: {} for c in CLASSES}
        self._moving: dict[Hashable, tuple[QosTag, int]] = {}
        self._asked: dict[Hashable, tuple[QosTag, int]] = {}
        self._overdue: dict[Hashable, tuple[QosTag, int]] = {}  # moving, but no longer holding a place (``overdue``)
        self._passed = dict.fromkeys(CLASSES, 0)  # grants made while this class waited
        self._order = itertools.count()

    def ask(self, key: Hashable, tag: QosTag, nbytes: int) -> list[Hashable]:
        if key in self._asked or key in self._moving or key in self._overdue:
            raise InvalidArgument("chunk", repr(key), "already asked for the wire")
        lane = self._lanes[tag.priority]
        tenant = lane.get(tag.tenant)
        if tenant is None:
            tenant = lane[tag.tenant] = _Tenant(self.shares.get(tag.tenant, 1.0))
        if not tenant.waiting and not tenant.moving:  # back from idle: no credit banked while away
            busy = [t.start for t in lane.values() if t.waiting or t.moving]
            tenant.start = max(tenant.start, min(busy, default=tenant.start))
        heapq.heappush(tenant.waiting, (tag.deadline, next(self._order), key))
        self._asked[key] = (tag, nbytes)
        return self._grant()

    def done(self, key: Hashable, again: int = 0) -> list[Hashable]:
        """A granted chunk moved, or one asked is abandoned: its place goes to
        the next. ``again``: the same read asks for its next chunk of so many
        bytes in the same breath, so it competes for the place it leaves (a
        read that asked only after would find the place given away, and
        shares would not hold)."""
        moved = self._moving.pop(key, None)
        if moved is None:
            moved = self._overdue.pop(key, None)  # its place was given up already; it was still moving
        if moved is not None:
            self._lanes[moved[0].priority][moved[0].tenant].moving -= 1
        if moved is None:
            asked = self._asked.pop(key, None)
            if asked is not None:  # still waiting: drop it from its heap
                tenant = self._lanes[asked[0].priority][asked[0].tenant]
                tenant.waiting = [w for w in tenant.waiting if w[2] != key]
                heapq.heapify(tenant.waiting)
        elif again:
            return self.ask(key, moved[0], again)
        return self._grant()

    def force(self, key: Hashable) -> None:
        """Let waiting ``key`` move now, over every limit: the shell's bound on a
        wait, so a chunk whose send is stuck on a reader that stopped reading
        (its place held until the send times out) wedges no one else."""
        tag, nbytes = self._asked.pop(key)
        tenant = self._lanes[tag.priority][tag.tenant]
        tenant.waiting = [w for w in tenant.waiting if w[2] != key]
        heapq.heapify(tenant.waiting)
        tenant.start += nbytes / tenant.share
        tenant.moving += 1
        self._moving[key] = (tag, nbytes)

    def overdue(self, keys: list[Hashable]) -> list[Hashable]:
        """``keys``, granted, have moved for longer than the shell's bound (a
        send blocked on a reader that stopped reading, until it times out):
        they stop holding places, which go to the next. Their ``done`` still
        comes. Without this every other chunk would wait out the bound, one
        at a time, for as long as those sends stay stuck."""
        for key in keys:
            moved = self._moving.pop(key, None)
            if moved is not None:
                # Still on the wire: its tenant keeps counting it as moving, so
                # that it is not taken for back from idle (and its credit kept).
                self._overdue[key] = moved
        return self._grant()

    def queued(self, key: Hashable) -> bool:
        """Whether ``key`` waits for the wire."""
        return key in self._asked

    def queues(self) -> list[QueueStatus]:
        return [QueueStatus(priority, name, len(tenant.waiting), tenant.moving)
                for priority, lane in self._lanes.items() for name, tenant in sorted(lane.items())]

    # ------------------------------------------------------------ policy

    def _waiting(self, priority: str) -> bool:
        return any(t.waiting for t in self._lanes[priority].values())

    def _moving_in(self, priorities: tuple[str, ...]) -> int:
        return sum(1 for tag, _ in self._moving.values() if tag.priority in priorities)

    def _next_class(self) -> str | None:
        """The class whose chunk starts next, or None: no free place for any waiting one."""
        shared = CLASSES[1:]
        candidates = []
        if self._waiting(CLASSES[0]) and self._moving_in(CLASSES[:1]) < self.slots:
            candidates.append(CLASSES[0])  # its own lane
        if self._moving_in(shared) < self.slots:
            candidates += [c for c in shared if self._waiting(c)]
        if not candidates:
            return None
        for c in reversed(candidates):  # a lower class passed over FLOOR times goes now
            if c != candidates[0] and self._passed[c] >= FLOOR:
                return c
        first = candidates[0]
        if first != CLASSES[0] and (self._waiting(CLASSES[0]) or self._moving_in(CLASSES[:1])):
            return None  # interactive is on the wire or waits: only what moves finishes
        return first

    def _grant(self) -> list[Hashable]:
        granted = []
        while (priority := self._next_class()) is not None:
            lane = self._lanes[priority]
            name = min((n for n, t in lane.items() if t.waiting), key=lambda n: (lane[n].start, n))
            tenant = lane[name]
            _deadline, _order, key = heapq.heappop(tenant.waiting)
            tag, nbytes = self._asked.pop(key)
            tenant.start += nbytes / tenant.share
            tenant.moving += 1
            self._moving[key] = (tag, nbytes)
            for c in CLASSES:
                self._passed[c] = 0 if c == priority else self._passed[c] + (1 if self._waiting(c) else 0)
            granted.append(key)
        return granted
