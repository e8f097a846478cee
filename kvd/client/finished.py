"""The finished sets a worker receives from its daemon: ``Finished`` (what
vLLM's ``get_finished`` and ``get_block_ids_with_load_errors`` return), and
``FinishedFeed``, which gathers the daemon's pushes on a thread of its own so
an engine step reads them with no round trip. No gRPC here: the client
(``kvd.client``) opens the stream and converts what it carries."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvd.core.aggregate import Outcome
from kvd.errors import DeadlineExceeded, KvdError, Unavailable
from kvd.spec import WorkerId


@dataclass
class Finished:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    details: dict[tuple[str, str], Outcome] = field(default_factory=dict)  # by (direction, request_id)

    def merge(self, other: Finished) -> None:
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.invalid_block_ids |= other.invalid_block_ids
        self.details.update(other.details)


class Pushes(Protocol):
    """An open stream of pushed sets (``kvd.client.FinishedStream``)."""

    last_seq: int  # the last push received: a new stream resumes after it

    def __iter__(self) -> Iterator[Finished]: ...

    def cancel(self) -> None: ...


class Watches(Protocol):
    """What a feed needs of its client (``KvdClient``)."""

    worker: WorkerId

    def watch_finished(self, resume_after: int | None = None) -> Pushes: ...


class FinishedFeed:
    """A worker's finished sets, pushed by its daemon and gathered by a
    background thread, so an engine step reads them (``take``) without a round
    trip.

    A stream that breaks is reopened, up to ``reconnect_attempts`` times in a
    row with a doubling pause, resuming after the last push received: the
    daemon resends what the break may have lost, and what it emitted
    meanwhile waited in the worker's box, so nothing is lost. A daemon that
    stays away, or refuses the stream (the worker is no longer registered
    with it: it restarted), sets ``error`` and stops the thread.
    """

    def __init__(self, client: Watches, *, reconnect_attempts: int = 5, backoff_seconds: float = 0.05,
                 on_error: Callable[[FinishedFeed, KvdError], None] | None = None) -> None:
        self._client = client
        self._on_error = on_error  # called from the feed's thread, with this feed, once ``error`` is set
        self._reconnect_attempts = reconnect_attempts
        self._backoff_seconds = backoff_seconds
        self._cond = threading.Condition()  # guards _pending, _error, _stream
        self._pending = Finished()
        self._error: KvdError | None = None
        self._stream: Pushes | None = None
        self._stop = threading.Event()
        self.subscribed = threading.Event()  # the first stream's backlog arrived
        self._thread = threading.Thread(target=self._run, name=f"kvd-finished-{client.worker.tp_rank}-{client.worker.pp_rank}", daemon=True)

    def start(self) -> FinishedFeed:
        self._thread.start()
        return self

    @property
    def error(self) -> KvdError | None:
        """Why the feed stopped (the daemon went away), or None while it runs.
        Read it before ``take``: everything received before it was set is then
        in what ``take`` returns."""
        return self._error

    def take(self) -> Finished:
        """What arrived since the last take (no RPC: swaps the gathered sets)."""
        with self._cond:
            out, self._pending = self._pending, Finished()
        return out

    def wait_finished(self, recving: set[str] = frozenset(), sending: set[str] = frozenset(), timeout: float = 60.0) -> Finished:  # type: ignore[assignment]
        """Take until every id in ``recving``/``sending`` arrived; returns all taken."""
        seen = Finished()
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                seen.merge(self._pending)
                self._pending = Finished()
                if recving <= seen.finished_recving and sending <= seen.finished_sending:
                    return seen
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"not pushed after {timeout}s: recving={sorted(recving - seen.finished_recving)[:5]} sending={sorted(sending - seen.finished_sending)[:5]}")
                self._cond.wait(left)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until something is pending to take
        (or the feed failed); whether it is."""
        with self._cond:
            def ready() -> bool:
                p = self._pending
                return bool(p.finished_sending or p.finished_recving or p.invalid_block_ids) or self._error is not None

            return self._cond.wait_for(ready, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the stream and join the thread; what was gathered stays takeable."""
        self._stop.set()
        with self._cond:
            stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        resume_after: int | None = None  # a new subscription first, then resumed
        while True:
            with self._cond:
                # Checked under the lock close() takes: it either sees this stream or we see the stop.
                if self._stop.is_set():
                    return
                stream = self._stream = self._client.watch_finished(resume_after)
            try:
                for f in stream:
                    failures = 0  # the daemon answered: a later break starts a fresh count
                    with self._cond:
                        self._pending.merge(f)
                        self._cond.notify_all()
                    self.subscribed.set()
                # A clean end: the daemon ended our registration's stream; reopening tells why.
                why: KvdError = Unavailable("the daemon ended the finished stream")
            except KvdError as e:
                why = e
            resume_after = stream.last_seq
            if self._stop.is_set():
                return
            failures += 1
            # Only a lost connection may heal; a refusal (not registered, bad token) will not.
            if not isinstance(why, Unavailable | DeadlineExceeded) or failures > self._reconnect_attempts:
                with self._cond:
                    self._error = why
                    self._cond.notify_all()
                if self._on_error is not None:
                    self._on_error(self, why)
                return
            if self._stop.wait(self._backoff_seconds * 2 ** (failures - 1)):
                return
