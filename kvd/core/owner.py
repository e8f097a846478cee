"""The owner's side of the data plane, as decisions (pure; time is passed in).

``Owner`` answers what a prefill daemon is asked by readers: is this data
connection's HELLO from a reader that handshook with us, may this read be
served (capability, generation, lease, blocks, bounds), how many reader ranks
will read a rank (so the right ACK ends its publication), and is a read's
publication still alive before its END goes out. It holds the
``PublicationTable`` and the readers' handshakes, and returns the ends to
report; the daemon shell counts metrics and emits them.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from kvd.core.engine_meta import EngineMeta
from kvd.core.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvd.core.leases import (
    Ended,
    LayersAdvanced,
    PinKey,
    Publication,
    PublicationTable,
    RankKey,
    check_disjoint,
)
from kvd.core.pairing import engine_shape
from kvd.core.pieces import asked_nbytes, held_nbytes, validate_segment
from kvd.core.reads import MAX_STRIPES, DataRead
from kvd.core.relayout import GroupTensors
from kvd.core.topology import EngineShape, read_targets


@dataclass(frozen=True)
class Reader:
    """A daemon that handshook with us to read: its engine, and the secret
    its data connections must present."""

    meta: EngineMeta
    data_token: bytes


@dataclass(frozen=True)
class Grant:
    """An authorised read: the publication, and the pin a reader that copies
    our memory itself holds until its ACK (None otherwise)."""

    read: DataRead
    reader_engine: str
    publication: Publication
    pin: PinKey | None


class Owner:
    def __init__(self, engine_id: str, host_id: str, publications: PublicationTable, *, same_host: bool,
                 max_segments_per_read: int) -> None:
        self.engine_id = engine_id
        self.host_id = host_id
        self.publications = publications
        self.same_host = same_host  # readers on this host may copy our memory themselves
        self.max_segments_per_read = max_segments_per_read
        self.readers: dict[tuple[str, str], Reader] = {}  # by (engine id, epoch)
        self._seen: dict[tuple[str, str], float] = {}  # when each reader last handshook, said HELLO or read
        self._expected: dict[tuple[str, RankKey], int] = {}

    # ------------------------------------------------------------ handshakes

    def reader_joined(self, theirs: EngineMeta, now: float) -> Reader:
        """A reader handshook. It replaces the entries of its engine that it
        succeeds: a restarted daemon at the same address, and any daemon that
        held one of its ranks (a rank lives on one daemon: one rescheduled to
        another host comes back under a new address). Reader counts for its
        engine are redone."""
        mine = {(r.tp_rank, r.pp_rank) for r in theirs.ranks}
        for key in [k for k, r in self.readers.items() if k[0] == theirs.engine_id and (
                (r.meta.host_id == theirs.host_id and r.meta.data_address == theirs.data_address)
                or any((x.tp_rank, x.pp_rank) in mine for x in r.meta.ranks))]:
            self._drop_reader(key)
        key = (theirs.engine_id, theirs.epoch)
        reader = self.readers[key] = Reader(theirs, secrets.token_bytes(32))
        self._seen[key] = now
        self._expected = {k: v for k, v in self._expected.items() if k[0] != theirs.engine_id}
        return reader

    def _drop_reader(self, key: tuple[str, str]) -> None:
        del self.readers[key]
        self._seen.pop(key, None)

    def forget_idle_readers(self, now: float, idle_s: float, connected: Collection[tuple[str, str]]) -> list[tuple[str, str]]:
        """Forget the readers (engine id, epoch) that have neither handshook,
        said HELLO nor read for ``idle_s`` and hold no data connection
        (``connected``): a reader scaled away never says goodbye. One that
        comes back handshakes again (its next HELLO is refused UNAVAILABLE,
        which a reader retries with a new handshake). The keys forgotten."""
        gone = [k for k in self.readers if k not in connected and now - self._seen.get(k, now) >= idle_s]
        for key in gone:
            self._drop_reader(key)
        engines = {k[0] for k in gone}
        self._expected = {k: v for k, v in self._expected.items() if k[0] not in engines}
        return gone

    def reader(self, engine_id: str, epoch: str, now: float) -> Reader:
        """The reader as it last handshook (a connection it authenticated
        before a new handshake stays its own), seen at ``now``."""
        reader = self.readers.get((engine_id, epoch))
        if reader is None:
            raise Unauthenticated(f"engine {engine_id!r} epoch {epoch[:8]} has not handshaken with this daemon")
        self._seen[(engine_id, epoch)] = now
        return reader

    def check_hello(self, engine_id: str, epoch: str, data_token: bytes, shared_token_ok: bool, now: float) -> Reader:
        """Before a single byte of KV: the shared token (auth=token), then the
        per-reader secret our handshake issued."""
        reader = self.reader(engine_id, epoch, now)
        if not shared_token_ok or not hmac.compare_digest(data_token, reader.data_token):
            raise Unauthenticated("data-plane HELLO without valid credentials")
        return reader

    # ------------------------------------------------------------ reads

    def authorize(self, read: DataRead, reader: Reader, tensors: Sequence[GroupTensors] | None, now: float, *,
                  local: bool = False, reader_copies: bool = False, registration: int = 0) -> Grant:
        """May ``read`` be served to ``reader``? ``tensors`` are the read
        rank's registered groups (None: not registered), ``registration``
        their generation. ``local``: a same-host read; ``reader_copies``: the
        reader copies our memory itself (same host, NIXL), so the rank stays
        pinned until ``release``."""
        if local and (reader.meta.host_id != self.host_id or not self.same_host):
            raise PermissionDenied("a same-host read from a reader on another host (or with same_host=off)")
        if local and tensors is not None and read.mapped_registration != registration:
            # The reader mapped memory the worker has since left: copying it
            # would land another request's bytes (or none) as this one's.
            raise Unavailable(f"rank tp{read.tp_rank}/pp{read.pp_rank} registered again (registration {registration}) since the reader "
                              f"mapped registration {read.mapped_registration}: handshake again")
        if len(read.segments) > self.max_segments_per_read:
            raise InvalidArgument("read.segments", f"<{len(read.segments)} segments>", f"exceeds the limit of {self.max_segments_per_read}")
        if read.stripes > MAX_STRIPES or read.stripe >= max(1, read.stripes):
            raise InvalidArgument("read.stripe", f"{read.stripe} of {read.stripes}", f"must be below read.stripes, itself at most {MAX_STRIPES}")
        if read.owner_engine_id != self.engine_id:
            raise InvalidArgument("read.owner_engine_id", read.owner_engine_id, f"is not this daemon's engine {self.engine_id!r}")
        rank = read.rank
        if tensors is None:
            raise NotFound(f"rank tp{rank[0]}/pp{rank[1]} is not registered here")
        pub = self.publications.authorize(read.request_id, read.generation, read.capability, reader.meta.engine_id, rank, now)
        listed: dict[int, list[tuple[int, ...]]] = {}
        for seg in read.segments:
            if seg.group_id >= len(tensors):
                raise InvalidArgument("segment.group_id", seg.group_id, f"is not one of {len(tensors)} groups")
            validate_segment(tensors[seg.group_id], seg, *read.heads_of(seg))
            if seg.block_ids:
                listed.setdefault(seg.group_id, []).append(seg.block_ids)
            else:
                self.publications.check_blocks(pub, rank, seg.group_id, seg.block_start, seg.block_count)
        # A group's batched ids are checked at once: a read of a 128k-token
        # request has a thousand segments, and numpy's cost per call was
        # half of its authorisation.
        for group, lists in listed.items():
            self.publications.check_block_list(pub, rank, group, np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64))
        # A reader reads each published byte at most once a READ (a stripe, a head slice, a block size's
        # pieces are parts of it): segments, block ids or layers repeated made one READ send a
        # publication thousands of times over.
        asked, held = asked_nbytes(tensors, read), held_nbytes(tensors, pub.block_ids.get(rank, []))
        if asked > held:
            raise InvalidArgument("read.segments", f"<{len(read.segments)} segments, {asked} bytes>",
                                  f"ask for more than the {held} bytes published on rank tp{rank[0]}/pp{rank[1]}")
        pin = self.publications.pin(pub, rank) if local or reader_copies else None
        return Grant(read, reader.meta.engine_id, pub, pin)

    def check_alive(self, read: DataRead, now: float) -> None:
        """Raise if the read's publication ended while it was served: the
        owner says END only after this holds past the last byte."""
        self.publications.check_alive(read.request_id, read.generation, read.rank, now)

    @staticmethod
    def layer_needs(read: DataRead, tensors: Sequence[GroupTensors]) -> list[int]:
        """Per segment, the layer watermark it needs (its last model layer
        + 1): a streaming publication serves a segment only once its rank's
        layers below that are saved."""
        return [max(tensors[s.group_id].layer_indices[p] for p in s.layers) + 1 for s in read.segments]

    def saved_below(self, read: DataRead, now: float) -> int:
        """The read rank's layer watermark; raises if the publication ended."""
        return self.publications.saved_below(read.request_id, read.generation, read.rank, now)

    def layers_saved(self, rank: RankKey, request_ids: Sequence[str], upto: int) -> LayersAdvanced:
        """A streaming worker wrote every layer below ``upto`` of these requests."""
        return self.publications.layers_saved(rank, request_ids, upto)

    def release(self, grant: Grant) -> list[Ended]:
        """The read is over (acknowledged, refused midway, connection gone):
        an end held for its pin is reported now."""
        return self.publications.unpin(grant.pin) if grant.pin is not None else []

    def acknowledged(self, grant: Grant, mine: EngineMeta) -> list[Ended]:
        """The reader's ACK: every byte landed. Ends the rank once every
        expected reader (and stripe) has acknowledged; ranks nobody reads
        (replicated heads, MLA) end with the last rank that is read."""
        read, reader, table = grant.read, grant.reader_engine, self.publications
        rank = read.rank
        shape = engine_shape(mine)
        ended = table.ack(read.request_id, read.generation, rank, (reader, read.reader_tp_rank, read.reader_pp_rank),
                          max(1, self.expected_readers(reader, rank, shape)), read.stripe, read.stripes)
        pub = table.by_request.get(read.request_id)
        if ended and pub is not None and pub.generation == read.generation:
            unread = [r for r in pub.masks if self.expected_readers(reader, r, shape) == 0]
            if len(unread) == len(pub.masks):
                for r in unread:
                    ended.extend(table.ack(read.request_id, read.generation, r, (reader, -1, -1), 1))
        return ended

    def expected_readers(self, reader_engine: str, rank: RankKey, mine: EngineShape) -> int:
        """How many ranks of ``reader_engine`` will read our ``rank``.

        Counted over the reader engine's whole TP x PP shape; a rank copies from
        a replica instead (fan-out) only when both sit on one daemon we have
        handshaken with. Unknown ranks are assumed to read: over-counting only
        delays the release to lease expiry, under-counting would refuse a read.
        """
        key = (reader_engine, rank)
        if key not in self._expected:
            daemons = [r.meta for (eid, _), r in self.readers.items() if eid == reader_engine]
            if not daemons:
                return 1
            merged = dataclasses.replace(daemons[0], ranks=tuple(r for m in daemons for r in m.ranks))
            theirs = engine_shape(merged)
            # A stage we know nothing of: assume each of its ranks reads.
            count = theirs.tp_size * sum(pp not in theirs.layers_by_pp_rank for pp in range(theirs.pp_size))
            for pp in theirs.layers_by_pp_rank:
                for tp in range(theirs.tp_size):
                    home = next((m for m in daemons if m.rank(tp, pp) is not None), None)
                    present = frozenset((r.tp_rank, r.pp_rank) for r in home.ranks) if home else frozenset()
                    targets = read_targets(theirs, mine, tp, pp, present)
                    count += any((t.remote_tp_rank, t.remote_pp_rank) == rank for t in targets)
            self._expected[key] = count
        return self._expected[key]

    # ------------------------------------------------------------ the reader's other calls

    def renew(self, leases: Sequence[tuple[str, int, bytes]], now: float) -> list[bool]:
        """Heartbeat: which of (request id, generation, capability) are still held."""
        return [self.publications.renew(rid, gen, cap, now) for rid, gen, cap in leases]

    def publish(self, rank: RankKey, request_id: str, block_ids: Sequence[Sequence[int] | np.ndarray], tensors: Sequence[GroupTensors],
                num_tokens: int, now: float, *, capability: bytes = b"", reader_engine_id: str = "",
                lease_s: float = 0.0, first_tokens: Sequence[int] = (), stream: bool = False,
                sharing: Sequence[tuple[int, int]] = ()) -> tuple[Publication, list[Ended]]:
        """Offer ``rank``'s blocks; and what ends at once because this
        publication already ended (aborted by its reader before we
        published, or read and finished before this rank published).
        ``sharing``: positions of groups on the same memory (``sharing_groups``)."""
        if sharing:
            check_disjoint("block_ids", [np.asarray(b, dtype=np.int64) for b in block_ids], sharing)
        pub = self.publications.publish(
            rank, request_id, block_ids, [g.spec.num_blocks for g in tensors], num_tokens, now, capability=capability,
            reader_engine_id=reader_engine_id, lease_s=lease_s,
            # A state part holds no tokens: its blocks are not checked against num_tokens.
            block_sizes=[0 if g.spec.state else g.spec.block_size for g in tensors], first_tokens=first_tokens, stream=stream)
        return pub, self.publications.ended_before(request_id, capability, rank, now)

    def reader_aborted(self, request_id: str, generation: int, capability: bytes, reason: str, now: float) -> list[Ended] | None:
        """The reader will not read: end the publication now (None: no such
        publication). Generation 0 is a reader that had not resolved it yet;
        the capability names the publication. An abort that comes before
        any rank published is remembered, and ends their publish at once."""
        reason = reason or "aborted by the reader"
        pub = self.publications.matching(request_id, capability)
        if pub is None:
            if generation == 0:
                self.publications.bury(request_id, capability, "aborted", reason, now)
            return None
        if generation not in (0, pub.generation):
            return None
        return self.publications.abort(request_id, None, reason)
