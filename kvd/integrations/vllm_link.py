"""A vLLM worker's link to its daemon, across daemon restarts.

The daemon pushes the worker's outcomes into a ``FinishedFeed``. When the
feed fails (the daemon restarted: a crash, or a sidecar upgrade; or it
refused the stream), ``DaemonLink`` registers the worker's caches again in a
background thread, once a daemon answers (an idle engine does not step), and
hands the engine thread the failed feed (``take_loss``: what it received
before failing, and the event the rejoin sets once the old registration's
work has ended) and then the new one (``swap``). Transfers the engine starts
after the swap belong to the new registration; those of the lost one are
the worker's to settle (``vllm_worker.WorkerSide``).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from kvd.client import FinishedFeed, KvdClient
from kvd.convert import params_to_pb
from kvd.core.requests import TransferParams
from kvd.errors import DeadlineExceeded, KvdError, Unavailable

log = logging.getLogger("vllm.kvd")

# After a refusal that retrying will not cure (the daemon runs another
# engine, the worker's caches no longer match it), try again this seldom.
REFUSED_RETRY_SECONDS = 60.0
# Releases kept until the daemon takes them (the newest; an older one is
# left to its publication's lease).
MAX_PENDING_RELEASES = 4096


def send_release(client: KvdClient, request_id: str, params: TransferParams) -> bool | None:
    """Tell P, through our daemon, that we will not read ``params`` (P frees
    its blocks before the lease ends). True once taken; None if the daemon
    did not answer; False if refused (logged, and left to the lease)."""
    try:
        client.abort(request_id, release=params_to_pb(params))
    except (Unavailable, DeadlineExceeded):
        return None
    except KvdError as e:
        log.info("kvd: could not release request %s on %s (its lease will): %s", params.request_id, params.remote_address, e.message)
        return False
    return True


class DaemonLink:
    def __init__(self, client: KvdClient, register_again: Callable[[], Any], address: str) -> None:
        self.client = client
        self._register_again = register_again
        self.address = address
        self._lock = threading.Lock()
        self.feed: FinishedFeed | None = self._new_feed()
        self._lost: FinishedFeed | None = None  # failed, for the engine thread to settle
        self._next: FinishedFeed | None = None  # the rejoined registration's, for the engine thread to take up
        self._rejoined = threading.Event()  # the rejoin under way registered again
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Releases the daemon could not take (it was down: loads it refused, or
        # a lost registration's): P holds their blocks for its lease (120 s by
        # default) unless told, and a D sidecar restart under load filled P's
        # cache that way. Sent from a thread of their own once the link is whole.
        self._releases: collections.deque[tuple[str, TransferParams]] = collections.deque(maxlen=MAX_PENDING_RELEASES)
        self._dropped = 0  # past MAX_PENDING_RELEASES: left to their leases
        self._flusher: threading.Thread | None = None

    def release(self, request_id: str, params: TransferParams) -> None:
        """Tell P, through our daemon, that we will not read ``params``; if the daemon is down, once it is back."""
        if send_release(self.client, request_id, params) is None:
            self.release_later(request_id, params)

    def release_later(self, request_id: str, params: TransferParams) -> None:
        """A release for the daemon once it answers this worker registered (``flush_releases``)."""
        with self._lock:
            if len(self._releases) == MAX_PENDING_RELEASES:
                self._dropped += 1
            self._releases.append((request_id, params))

    def flush_releases(self) -> None:
        """From the engine thread: with releases kept and the link whole (a
        feed taken up, no rejoin under way), send them off the engine thread.
        (The rejoin starts the same once registered: an idle engine does not step.)"""
        with self._lock:
            if self._thread is None and self._lost is None and self.feed is not None:
                self._start_flusher()

    def _start_flusher(self) -> None:
        """Under the lock, this worker registered with the daemon that answers."""
        if self._releases and self._flusher is None and not self._stop.is_set():
            self._flusher = threading.Thread(target=self._send_releases, name="kvd-releases", daemon=True)
            self._flusher.start()

    def _send_releases(self) -> None:
        sent = 0
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not self._releases:
                        break
                    rid, params = self._releases.popleft()
                try:
                    answered = send_release(self.client, rid, params)
                except ValueError:  # the channel closed under us (close())
                    break
                if answered is None:  # gone again: sent once the link is whole again
                    with self._lock:
                        if len(self._releases) < MAX_PENDING_RELEASES:
                            self._releases.appendleft((rid, params))
                    break
                sent += answered
        finally:
            with self._lock:
                self._flusher, dropped, self._dropped = None, self._dropped, 0
            if sent:
                log.warning("kvd: released %d publications this worker could not read while its daemon was down", sent)
            if dropped:
                log.warning("kvd: %d releases past the %d kept were left to their leases", dropped, MAX_PENDING_RELEASES)

    def _new_feed(self) -> FinishedFeed:
        return FinishedFeed(self.client, on_error=self._failed).start()

    def _failed(self, feed: FinishedFeed, error: KvdError) -> None:
        """From a feed's thread: its stream is gone for good."""
        with self._lock:
            if feed is self.feed and self._lost is None:
                self._lost = feed
            elif feed is self._next:
                self._next = None  # failed before the engine took it up: no transfer of the engine's is on it
            else:
                return
            if self._thread is None and not self._stop.is_set():
                self._rejoined = threading.Event()
                self._thread = threading.Thread(target=self._rejoin, name="kvd-rejoin", daemon=True)
                self._thread.start()
        log.error("kvd: lost the daemon at %s (%s): registering again once it answers", self.address, error.message)

    def take_loss(self) -> tuple[FinishedFeed, bool, threading.Event] | None:
        """From the engine thread: the failed feed (to take what it received),
        whether the daemon was unreachable (its work ended with it) rather
        than refusing, and the event set once the worker registered again
        (which ends the old registration's work on a daemon still alive)."""
        with self._lock:
            lost, self._lost = self._lost, None
            if lost is None:
                return None
            if self.feed is lost:
                self.feed = None
            return lost, isinstance(lost.error, Unavailable | DeadlineExceeded), self._rejoined

    def swap(self) -> None:
        """From the engine thread: take up the new registration's feed."""
        with self._lock:
            if self.feed is None and self._next is not None and self._lost is None:
                self.feed, self._next = self._next, None

    def _rejoin(self) -> None:
        delay = 0.1
        try:
            while not self._stop.is_set():
                try:
                    self.client.wait_ready(timeout=5.0)
                    self._register_again()
                except grpc.FutureTimeoutError:
                    log.info("kvd: the daemon at %s is not back yet", self.address)
                except KvdError as e:
                    if isinstance(e, Unavailable | DeadlineExceeded):
                        log.info("kvd: the daemon at %s is not back yet: %s", self.address, e.message)
                    else:
                        log.error("kvd: the daemon at %s refuses this worker's registration (retrying in %gs): %s",
                                  self.address, REFUSED_RETRY_SECONDS, e.message)
                        delay = REFUSED_RETRY_SECONDS
                else:
                    with self._lock:
                        if self._stop.is_set():
                            return
                        self._next = self._new_feed()
                        self._rejoined.set()
                        self._thread = None  # a loss from now on starts a rejoin of its own
                        self._start_flusher()
                    log.warning("kvd: registered again with the daemon at %s (it restarted)", self.address)
                    return
                self._stop.wait(delay)
                delay = min(2.0, delay * 2) if delay < REFUSED_RETRY_SECONDS else delay
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def close(self) -> None:
        """Stop any rejoin (so nothing registers after an unregister) and every feed."""
        self._stop.set()
        for thread in (self._thread, self._flusher):
            if thread is not None:
                thread.join(timeout=10)
        with self._lock:
            feeds = [f for f in (self.feed, self._next, self._lost) if f is not None]
            self.feed = self._next = self._lost = None
        for f in feeds:
            f.close()
