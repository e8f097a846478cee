"""Publications, generations, capabilities and leases (pure; time is passed in).

A publish makes a ``Publication``: the blocks one P rank offers for one
request, bound to a fresh *generation* and an unguessable *capability*, and
held by a lease until every expected reader has acknowledged its read, the
lease expires, or someone aborts. Reads are authorised against all of these,
so a reused block id can never serve an older request's data: the old
generation is gone from the table the moment its publication ends.

The owner's engine reuses a rank's blocks the moment its end is reported
(finished_sending). A read that copies the owner's memory itself after being
authorised (same host, NIXL) therefore *pins* the rank: while pinned, an end
(abort, expiry) still refuses new reads at once, but is reported only when
the last pin goes. A read whose bytes the owner sends needs no pin: the owner
checks the publication after its last byte left and before saying END.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvd.core.spec import check_request_id

CAPABILITY_BYTES = 32
# Publications that ended are remembered by (request id, capability) for a
# lease, so that a rank publishing the same request later (an abort that
# came first, a rank nobody reads publishing after the read) ends at once
# instead of holding its blocks to its lease. Bounded: oldest forgotten first.
MAX_TOMBSTONES = 4096
RankKey = tuple[int, int]  # (tp_rank, pp_rank)
PinKey = tuple[str, int, RankKey]  # (request_id, generation, rank)
ReaderKey = tuple[str, int, int]  # a reading rank: (engine id, tp_rank, pp_rank)
# What a publish holds its blocks for, with no renewal, unless the daemon's
# --lease-seconds or the publish says otherwise.
DEFAULT_LEASE_SECONDS = 120.0
# A lease is how long P holds blocks for a reader that does not come. Past a
# day that is a leak, not a wait; before this bound a publish's NaN or
# negative lease quietly became the default, and inf held its blocks forever.
MAX_LEASE_SECONDS = 86400.0


def check_lease_seconds(field_name: str, value: float) -> float:
    """A publish's lease: 0 (the daemon's default) or up to ``MAX_LEASE_SECONDS``."""
    if not 0 <= value <= MAX_LEASE_SECONDS:  # NaN fails too
        raise InvalidArgument(field_name, value, f"must be in [0, {MAX_LEASE_SECONDS:g}] seconds (0: the daemon's default)")
    return value
# A rank's layer watermark when it published whole (not streaming): every layer is saved.
ALL_LAYERS = 1 << 31


@dataclass(frozen=True)
class LayersAdvanced:
    """What one ``layers_saved`` call moved: how many publications, and how
    many of their layers became saved (the same total in whatever order a
    rank's calls arrive)."""

    publications: int
    layers: int


@dataclass
class Publication:
    request_id: str
    generation: int
    capability: bytes
    reader_engine_id: str
    num_tokens: int
    expires_at: float
    # per rank: per group, a bool mask over block ids
    masks: dict[RankKey, list[np.ndarray]] = field(default_factory=dict)
    block_ids: dict[RankKey, list[np.ndarray]] = field(default_factory=dict)
    # per rank: per reader (engine, tp rank, pp rank), its stripes and those it ACKed
    acked: dict[RankKey, dict[ReaderKey, tuple[int, set[int]]]] = field(default_factory=dict)
    lease_s: float = 0.0  # what one renewal extends by
    first_tokens: tuple[int, ...] = ()  # per group, as the first rank published them
    # Per rank: every model layer below this is written (layer-wise
    # streaming publishes before computing; ALL_LAYERS when published whole).
    saved: dict[RankKey, int] = field(default_factory=dict)
    stream: bool = False

    def live(self, now: float) -> bool:
        """The one lease check: every read, renewal and sweep asks it."""
        return now < self.expires_at


@dataclass(frozen=True)
class Ended:
    """A rank's publication ended: report ``request_id`` in finished_sending."""

    rank: RankKey
    request_id: str
    outcome: str  # done | expired | aborted
    reason: str = ""


class PublicationTable:
    def __init__(self, default_lease_s: float, epoch: str) -> None:
        self.default_lease_s = default_lease_s
        self.epoch = epoch
        self._next_generation = 1
        self.by_request: dict[str, Publication] = {}
        self._pins: dict[PinKey, int] = {}
        self._held: dict[PinKey, Ended] = {}  # ended while pinned: reported at unpin
        self._tombstones: dict[tuple[str, bytes], tuple[float, str, str]] = {}  # -> (until, outcome, reason)

    def __len__(self) -> int:
        return len(self.by_request)

    def publish(
        self,
        rank: RankKey,
        request_id: str,
        block_ids: Sequence[Sequence[int] | np.ndarray],
        num_blocks: Sequence[int],
        num_tokens: int,
        now: float,
        *,
        capability: bytes = b"",
        reader_engine_id: str = "",
        lease_s: float = 0.0,
        block_sizes: Sequence[int] = (),
        first_tokens: Sequence[int] = (),
        stream: bool = False,
    ) -> Publication:
        """Offer ``rank``'s blocks of ``request_id``. With ``block_sizes``
        (tokens per block, per group), every group must hold the prompt up to
        ``num_tokens``, from its ``first_tokens`` entry on (0 if none)."""
        check_request_id("request_id", request_id)
        if capability and len(capability) != CAPABILITY_BYTES:
            raise InvalidArgument("capability", f"<{len(capability)} bytes>", f"must be {CAPABILITY_BYTES} bytes")
        if len(block_ids) != len(num_blocks):
            raise InvalidArgument("block_ids", f"<{len(block_ids)} groups>", f"must give one list per KV cache group ({len(num_blocks)})")
        masks, arrays = [], []
        for g, (ids, n) in enumerate(zip(block_ids, num_blocks, strict=True)):
            arr = np.asarray(ids, dtype=np.int64)
            check_block_ids(f"block_ids[{g}]", arr, n)
            first = first_tokens[g] if g < len(first_tokens) else 0
            if g < len(block_sizes) and block_sizes[g] > 0:
                if first < 0 or first % block_sizes[g] or first >= num_tokens:
                    raise InvalidArgument(f"block_ids[{g}].first_token", first,
                                          f"must be a multiple of the block size {block_sizes[g]} below num_tokens={num_tokens}")
                if first + arr.size * block_sizes[g] < num_tokens:
                    raise InvalidArgument(f"block_ids[{g}]", f"<{arr.size} blocks>",
                                          f"of {block_sizes[g]} tokens from token {first} cannot hold num_tokens={num_tokens}")
            mask = np.zeros(n, dtype=bool)
            mask[arr] = True
            masks.append(mask)
            arrays.append(arr)
        lease = lease_s if lease_s > 0 else self.default_lease_s
        pub = self.by_request.get(request_id)
        if pub is None:
            pub = Publication(
                request_id=request_id,
                generation=self._next_generation,
                capability=capability or secrets.token_bytes(CAPABILITY_BYTES),
                reader_engine_id=reader_engine_id,
                num_tokens=num_tokens,
                expires_at=now + lease,
                lease_s=lease,
                first_tokens=tuple(first_tokens),
                stream=stream,
            )
            self._next_generation += 1
            self.by_request[request_id] = pub
        else:
            if capability and not hmac.compare_digest(capability, pub.capability):
                raise FailedPrecondition(f"request_id={request_id!r} is already published with another capability")
            if rank in pub.masks:
                raise FailedPrecondition(f"request_id={request_id!r} is already published by rank tp{rank[0]}/pp{rank[1]}")
            if tuple(first_tokens) != pub.first_tokens or num_tokens != pub.num_tokens:
                # Every rank holds the same tokens of the request: a reader plans one mapping for all.
                raise FailedPrecondition(f"request_id={request_id!r} tp{rank[0]}/pp{rank[1]} publishes num_tokens={num_tokens} and first_tokens="
                                         f"{list(first_tokens)}, other ranks {pub.num_tokens} and {list(pub.first_tokens)}")
            if stream != pub.stream:
                raise FailedPrecondition(f"request_id={request_id!r} tp{rank[0]}/pp{rank[1]} publishes stream={stream}, other ranks {pub.stream}")
            if (request_id, pub.generation, rank) in self._held:
                raise FailedPrecondition(f"request_id={request_id!r} of rank tp{rank[0]}/pp{rank[1]} ended but is still being read; publish it after its finished_sending")
            pub.expires_at = max(pub.expires_at, now + lease)
        pub.masks[rank] = masks
        pub.block_ids[rank] = arrays
        pub.acked[rank] = {}
        pub.saved[rank] = 0 if stream else ALL_LAYERS
        return pub

    def layers_saved(self, rank: RankKey, request_ids: Sequence[str], upto: int) -> LayersAdvanced:
        """``rank`` wrote every layer below ``upto`` of these streaming
        requests. A request not published here, or already further, is
        skipped: the worker may report after an abort or after the read
        ended (its step's end), and two of its calls may arrive out of
        order (the later one has then said it all)."""
        publications = layers = 0
        for rid in request_ids:
            pub = self.by_request.get(rid)
            if pub is None:
                continue
            was = pub.saved.get(rank, ALL_LAYERS)
            if was < upto:
                pub.saved[rank] = upto
                publications += 1
                layers += upto - was
        return LayersAdvanced(publications, layers)

    def saved_below(self, request_id: str, generation: int, rank: RankKey, now: float) -> int:
        """The layer watermark of a read's rank; raises like ``check_alive``
        if its publication ended."""
        self.check_alive(request_id, generation, rank, now)
        return self.by_request[request_id].saved.get(rank, ALL_LAYERS)

    def ended_before(self, request_id: str, capability: bytes, rank: RankKey, now: float) -> list[Ended]:
        """Right after ``rank`` published: if this publication (the same
        request id and capability) already ended, end the rank now too."""
        found = self._tombstones.get((request_id, capability))
        if not capability or found is None or now >= found[0]:
            return []
        pub = self.by_request.get(request_id)
        if pub is None or rank not in pub.masks:
            return []
        return self._end_rank(pub, rank, found[1], found[2])

    def bury(self, request_id: str, capability: bytes, outcome: str, reason: str, now: float) -> None:
        """Remember that this publication ended (or was aborted before any rank published)."""
        if len(capability) != CAPABILITY_BYTES:
            return
        while len(self._tombstones) >= MAX_TOMBSTONES:
            self._tombstones.pop(next(iter(self._tombstones)))
        self._tombstones[(request_id, capability)] = (now + self.default_lease_s, outcome, reason)

    def check_not_ended(self, request_id: str, capability: bytes, now: float) -> None:
        """Raise ``Aborted`` with its outcome if this publication (request id
        and capability) ended within a lease: a reader holding its capability
        hears why, not that nothing matches."""
        found = self._tombstones.get((request_id, capability))
        if found is not None and now < found[0]:
            raise Aborted(f"publication of request_id={request_id!r} ended before this read: {found[1]} ({found[2]})")

    def authorize(
        self, request_id: str, generation: int, capability: bytes, reader_engine_id: str, rank: RankKey, now: float
    ) -> Publication:
        """The publication a read may use, or the reason it may not."""
        pub = self.by_request.get(request_id)
        # Check the capability before saying anything else about the request.
        if pub is None or not hmac.compare_digest(capability, pub.capability):
            # A striped read's later stripes can arrive after an abort: say
            # that the publication ended, as a read already under way hears.
            self.check_not_ended(request_id, capability, now)
            raise PermissionDenied(f"no publication of request_id={request_id!r} matches this capability")
        if pub.generation != generation:
            raise PermissionDenied(f"request_id={request_id!r} generation={generation} is stale (current {pub.generation})")
        if pub.reader_engine_id and pub.reader_engine_id != reader_engine_id:
            raise PermissionDenied(f"request_id={request_id!r} may only be read by engine {pub.reader_engine_id!r}")
        if not pub.live(now):
            raise PermissionDenied(f"request_id={request_id!r} lease expired")
        if rank not in pub.masks:
            raise NotFound(f"request_id={request_id!r} is not published by rank tp{rank[0]}/pp{rank[1]}")
        return pub

    def check_alive(self, request_id: str, generation: int, rank: RankKey, now: float) -> None:
        """Raise if the publication a read is serving ended (aborted, expired)."""
        pub = self.by_request.get(request_id)
        if pub is None or pub.generation != generation or rank not in pub.masks:
            raise Aborted(f"publication of request_id={request_id!r} ended while being read")
        if not pub.live(now):
            raise Aborted(f"publication of request_id={request_id!r} expired while being read")

    def matching(self, request_id: str, capability: bytes) -> Publication | None:
        """The publication of ``request_id`` under ``capability``, if any."""
        pub = self.by_request.get(request_id)
        return pub if pub is not None and hmac.compare_digest(pub.capability, capability) else None

    @staticmethod
    def check_block_list(pub: Publication, rank: RankKey, group: int, ids: np.ndarray) -> None:
        masks = pub.masks[rank]
        if not 0 <= group < len(masks):
            raise InvalidArgument("segment.group_id", group, f"is not one of {len(masks)} groups")
        mask = masks[group]
        if ids.size and (ids.min() < 0 or ids.max() >= mask.shape[0]):
            raise InvalidArgument("segment.block_ids", int(ids.max()), f"is outside [0, {mask.shape[0]})")
        if not mask[ids].all():
            raise PermissionDenied(f"blocks {ids[~mask[ids]][:4].tolist()} of group {group} are not published for request_id={pub.request_id!r}")

    @staticmethod
    def check_blocks(pub: Publication, rank: RankKey, group: int, start: int, count: int) -> None:
        masks = pub.masks[rank]
        if not 0 <= group < len(masks):
            raise InvalidArgument("segment.group_id", group, f"is not one of {len(masks)} groups")
        mask = masks[group]
        if count <= 0 or start < 0 or start + count > mask.shape[0]:
            raise InvalidArgument("segment.block_start", start, f"with count {count} is outside [0, {mask.shape[0]})")
        if not mask[start : start + count].all():
            raise PermissionDenied(f"blocks [{start}, {start + count}) of group {group} are not all published for request_id={pub.request_id!r}")

    def pin(self, pub: Publication, rank: RankKey) -> PinKey:
        """An authorised read of ``rank`` will copy its memory itself."""
        key = (pub.request_id, pub.generation, rank)
        self._pins[key] = self._pins.get(key, 0) + 1
        return key

    def unpin(self, key: PinKey) -> list[Ended]:
        """That read is over (acknowledged, refused or gone): an end held for
        it is reported now."""
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
            return []
        self._pins.pop(key, None)
        held = self._held.pop(key, None)
        return [] if held is None else [held]

    @property
    def pinned(self) -> int:
        """Ranks whose blocks a read still copies."""
        return len(self._pins)

    def ack(self, request_id: str, generation: int, rank: RankKey, reader: ReaderKey, expected: int, stripe: int = 0, stripes: int = 1) -> list[Ended]:
        """A reader confirmed its read (stripe ``stripe`` of its ``stripes``);
        end the rank's publication once ``expected`` readers ACKed every one
        of their stripes. Counted per reader: readers of one rank may cut
        their reads into different numbers of stripes (they read different
        bytes of it: uneven pipeline stages, or a cut by size)."""
        pub = self.by_request.get(request_id)
        if pub is None or pub.generation != generation or rank not in pub.acked:
            return []
        readers = pub.acked[rank]
        _, seen = readers.setdefault(reader, (max(1, stripes), set()))
        seen.add(stripe)
        if sum(len(seen) >= n for n, seen in readers.values()) < expected:
            return []
        return self._end_rank(pub, rank, "done")

    def renew(self, request_id: str, generation: int, capability: bytes, now: float, lease_s: float = 0.0) -> bool:
        pub = self.matching(request_id, capability)
        if pub is None or pub.generation != generation or not pub.live(now):
            return False
        pub.expires_at = max(pub.expires_at, now + (lease_s or pub.lease_s or self.default_lease_s))
        return True

    def expire(self, now: float) -> list[Ended]:
        for key in [k for k, (until, _, _) in self._tombstones.items() if now >= until]:
            del self._tombstones[key]
        ended: list[Ended] = []
        for pub in [p for p in self.by_request.values() if not p.live(now)]:
            for rank in list(pub.masks):
                ended += self._end_rank(pub, rank, "expired", "lease expired before every reader acknowledged")
        return ended

    def abort(self, request_id: str, rank: RankKey | None = None, reason: str = "aborted") -> list[Ended]:
        pub = self.by_request.get(request_id)
        if pub is None:
            return []
        ranks = [rank] if rank is not None and rank in pub.masks else list(pub.masks) if rank is None else []
        return [e for r in ranks for e in self._end_rank(pub, r, "aborted", reason)]

    def abort_rank(self, rank: RankKey, reason: str) -> list[Ended]:
        """End everything ``rank`` published (its worker left or restarted)."""
        return [e for rid in [rid for rid, p in self.by_request.items() if rank in p.masks] for e in self.abort(rid, rank, reason)]

    def holds(self, rank: RankKey) -> bool:
        """Whether a publication still holds some of ``rank``'s blocks."""
        return any(rank in p.masks for p in self.by_request.values())

    def next_expiry(self) -> float | None:
        return min((p.expires_at for p in self.by_request.values()), default=None)

    def _end_rank(self, pub: Publication, rank: RankKey, outcome: str, reason: str = "") -> list[Ended]:
        """End ``rank``'s publication now; what to report now (nothing while pinned)."""
        pub.masks.pop(rank, None)
        pub.block_ids.pop(rank, None)
        pub.acked.pop(rank, None)
        pub.saved.pop(rank, None)
        if not pub.masks and self.by_request.get(pub.request_id) is pub:
            del self.by_request[pub.request_id]
            self.bury(pub.request_id, pub.capability, outcome, reason or "the request's publication had already ended", pub.expires_at)
        ended = Ended(rank, pub.request_id, outcome, reason)
        key = (pub.request_id, pub.generation, rank)
        if key in self._pins:
            self._held[key] = ended
            return []
        return [ended]


def check_block_ids(field: str, ids: np.ndarray, num_blocks: int) -> None:
    """Refuse a block id outside ``[0, num_blocks)`` or listed twice, naming it."""
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise InvalidArgument(field, bad, f"is outside the registered range [0, {num_blocks})")
    check_unique(field, ids)


def check_disjoint(field: str, ids: Sequence[np.ndarray], sharing: Sequence[tuple[int, int]]) -> None:
    """Refuse a block id given to two groups that share memory (``sharing``:
    pairs of group ids, the positions in ``ids``), naming both groups and the
    id: one group's bytes would silently overwrite the other's."""
    for i, j in sharing:
        both = np.intersect1d(ids[i], ids[j], assume_unique=True)
        if both.size:
            raise InvalidArgument(f"{field}[{j}]", int(both[0]),
                                  f"is also given to group {i}, which shares its memory (one block id, one group)")


def check_unique(field: str, ids: np.ndarray) -> None:
    """Refuse a block id listed twice, naming it: it would be read (or land) once, silently."""
    if ids.size < 2:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < 4 * ids.size + (1 << 16):
        # Block ids are dense (below the cache's block count): a count per id
        # is one pass, where np.unique sorts (20 ms at 100k ids).
        counts = np.bincount(ids, minlength=0)
        repeated = np.flatnonzero(counts > 1)
    else:
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        raise InvalidArgument(field, int(repeated[0]), "is listed more than once")
