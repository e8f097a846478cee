"""When D's daemon may tell P it will not read a publication any more.

A publication is read by every D rank that needs a part of it, and the ranks
of one engine usually share a daemon. One rank that fails (its check found a
mismatch, its worker aborted) must not end P's publication under a sibling
still reading it: the sibling would be refused, and all of its blocks, not
just the failed rank's, would come back invalid. So the daemon keeps, per
publication, how many of its pulls are still open and why any of them gave
up, and tells P once, when the last one ends.

A sibling whose Pull arrives after the others all ended finds the
publication released; the ranks of one engine send their Pulls in the same
step, which is shorter than any read that could fail before them.
"""

from __future__ import annotations

from dataclasses import dataclass

# (remote engine, its address, request id, capability): one publication, named
# before it is resolved, as every rank's params name it alike.
PublicationKey = tuple[str, str, str, bytes]


@dataclass
class _Readers:
    open: int = 0
    reason: str = ""  # why one of them gave up: what P is told at the end


@dataclass(frozen=True)
class Release:
    """Tell P: ``key``'s reader is done with it, for ``reason``."""

    key: PublicationKey
    reason: str


class ReaderRelease:
    """Open pulls per publication, and whether to release it as the last ends."""

    def __init__(self) -> None:
        self._open: dict[PublicationKey, _Readers] = {}

    def started(self, key: PublicationKey) -> None:
        self._open.setdefault(key, _Readers()).open += 1

    def ended(self, key: PublicationKey, gave_up: str = "") -> Release | None:
        """A pull of ``key`` ended; ``gave_up`` says why it won't read the rest
        ("" when it landed, or when P already ended the publication). Returns
        the release to send, once, when it was the last open pull and any of
        them gave up."""
        readers = self._open.get(key)
        if readers is None:
            return Release(key, gave_up) if gave_up else None  # not counted: nothing to wait for
        readers.open -= 1
        readers.reason = readers.reason or gave_up
        if readers.open > 0:
            return None
        del self._open[key]
        return Release(key, readers.reason) if readers.reason else None

    def open_pulls(self, key: PublicationKey) -> int:
        readers = self._open.get(key)
        return 0 if readers is None else readers.open
