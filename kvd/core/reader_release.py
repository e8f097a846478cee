"""When D's daemon may tell P it will not read a publication any more.

A publication is read by every D rank that needs a part of it, and the ranks
of one engine usually share a daemon. One rank that fails (its check found a
mismatch, its worker aborted, its Pull was refused) must not end P's
publication under a sibling still reading it: the sibling would be refused,
and all of its blocks, not just the failed rank's, would come back invalid.
So the daemon keeps, per publication, how many of its pulls are still open
and why any of them gave up, and tells P once, when none is open.

"None is open" is asked as the last pull ends (``ended`` says when a release
is due), and again when it is due (``due``). The ranks' Pulls of one step do
not arrive at once, so while a rank registered here has not been seen for
the publication, the release waits a grace period: a sibling whose Pull
comes within it keeps the publication, and the release waits for its end
too. Once every rank registered here has pulled it or said it will not,
none can come, and the release is due at once. The shell keeps the clock.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

from kvd.core.leases import RankKey
from kvd.core.requests import TransferParams

# (remote engine, its address, request id, capability): one publication, named
# before it is resolved, as every rank's params name it alike.
PublicationKey = tuple[str, str, str, bytes]

# How long a release waits for a sibling rank registered here that has not
# yet pulled the publication: the Pulls of one engine step arrive together.
RELEASE_GRACE_SECONDS = 0.2


def publication(params: TransferParams) -> PublicationKey:
    return (params.remote_engine_id, params.remote_address, params.request_id, params.capability)


@dataclass
class _Readers:
    params: TransferParams  # the most resolved seen: what P is told with
    open: int = 0
    reason: str = ""  # why one of them gave up: what P is told at the end
    seen: set[RankKey] = field(default_factory=set)  # the ranks here that pulled it or said they will not


@dataclass(frozen=True)
class Release:
    """Tell P, with ``params``, that this reader is done with the publication, for ``reason``."""

    params: TransferParams
    reason: str


class ReaderRelease:
    """Open pulls per publication, and whether to release it once none is."""

    def __init__(self) -> None:
        self._open: dict[PublicationKey, _Readers] = {}

    def started(self, params: TransferParams, rank: RankKey) -> None:
        readers = self._entry(params)
        readers.open += 1
        readers.seen.add(rank)

    def ended(self, params: TransferParams, rank: RankKey, ranks_here: Set[RankKey], gave_up: str = "") -> float | None:
        """A pull of ``params`` by ``rank`` ended; ``gave_up`` says why it won't
        read the rest ("" when it landed, or when P already ended the
        publication). ``ranks_here``: the ranks registered here now. The
        seconds after which to ask ``due`` (0: now), or None: no release."""
        readers = self._entry(params)
        readers.open = max(readers.open - 1, 0)
        return self._settle(publication(params), readers, ranks_here, gave_up)

    def give_up(self, params: TransferParams, rank: RankKey, ranks_here: Set[RankKey], reason: str) -> float | None:
        """``rank`` will not pull ``params`` (refused, or not needed); as ``ended``."""
        readers = self._entry(params)
        readers.seen.add(rank)
        return self._settle(publication(params), readers, ranks_here, reason)

    def due(self, key: PublicationKey) -> Release | None:
        """The grace is over: the release to send now, once, if still none is open."""
        readers = self._open.get(key)
        if readers is None or readers.open or not readers.reason:
            return None
        del self._open[key]
        return Release(readers.params, readers.reason)

    def open_pulls(self, key: PublicationKey) -> int:
        readers = self._open.get(key)
        return 0 if readers is None else readers.open

    def _entry(self, params: TransferParams) -> _Readers:
        key = publication(params)
        readers = self._open.get(key)
        if readers is None:
            readers = self._open[key] = _Readers(params)
        elif params.generation and not readers.params.generation:
            readers.params = params
        return readers

    def _settle(self, key: PublicationKey, readers: _Readers, ranks_here: Set[RankKey], gave_up: str) -> float | None:
        readers.reason = readers.reason or gave_up
        if readers.open:
            return None
        if not readers.reason:
            del self._open[key]  # every reader landed: P ends it on their acknowledgements
            return None
        return 0.0 if readers.seen >= ranks_here else RELEASE_GRACE_SECONDS
