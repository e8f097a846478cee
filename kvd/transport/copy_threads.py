"""The daemon's copy threads: relayouts and same-host copies on every core.

A relayout (layout, block size, head slice) and a same-host copy are memory
passes that one thread runs at about half of what the node's memory gives
(a strided copy of 256-byte head rows: 0.5x a one-thread memcpy on this
project's 2-core machine; on two threads 0.95x). torch's ``copy_``,
``memcpy`` and ``process_vm_readv`` all drop the GIL, so plain threads run
them in parallel; torch's own intra-op pool stays at one thread because its
OpenMP workers spin between ops and take cores from the sockets.

Work comes as a ``Batch`` of jobs. ``run`` waits for its batch and helps
with it; ``submit`` returns at once, so a reader can receive segment k+1
while segment k lands. The threads are long-lived and take batches from one
queue: while segments keep coming they never sleep between them. Waking a
sleeping thread costs 50-70 us on this project's VM; when every 4 MiB
segment was handed over and waited for on its own, that was about a sixth
of a relayout's time.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from kvd.core.relayout import Copy, split_copies
from kvd.transport.thread_nice import set_thread_nice

_on_worker = threading.local()

# Below this a copy stays whole: handing it to a thread costs more than the
# thread saves (a thread wake-up is tens of us; 1 MiB copies in ~100 us).
PARALLEL_MIN_BYTES = 1 << 20

Job = Callable[[], object]


class Batch:
    """Jobs that any thread may take, one at a time. After a failure no job
    starts; the batch is done once the jobs already running have stopped
    (they may be writing into memory the caller is about to reuse)."""

    def __init__(self, jobs: Sequence[Job], on_done: Callable[[Batch], None] | None = None) -> None:
        self._jobs = list(jobs)
        self._next = 0
        self._running = 0
        self._finished = False
        self._lock = threading.Lock()
        self._on_done = on_done
        # Held until the batch is done: a lock costs 0.05 us to make, an Event
        # 2 (a state part's segment, a few KiB, lands in about as long).
        self._unfinished = threading.Lock()
        self._unfinished.acquire()
        self.failure: BaseException | None = None
        self.started_at: float | None = None  # perf_counter when its first job started
        self.seconds = 0.0  # first job's start to last job's end
        if not self._jobs:
            self._finish()

    def _take(self) -> Job | None:
        with self._lock:
            if self.failure is not None or self._next == len(self._jobs):
                return None
            job = self._jobs[self._next]
            self._next += 1
            self._running += 1
            if self.started_at is None:
                self.started_at = time.perf_counter()
            return job

    def drain(self) -> None:
        """Run this batch's jobs on the calling thread until none is left."""
        while (job := self._take()) is not None:
            failure = None
            try:
                job()
            except BaseException as e:
                failure = e
                # Its traceback's frames (the job's) hold views of registered memory, which would stay
                # mapped as long as the batch keeps the failure: their locals go, the lines stay.
                traceback.clear_frames(e.__traceback__)
            del job
            with self._lock:
                self._running -= 1
                if failure is not None and self.failure is None:
                    self.failure = failure
                last = (self._running == 0 and not self._finished
                        and (self.failure is not None or self._next == len(self._jobs)))
                self._finished = self._finished or last
            if last:
                self._finish()

    def _finish(self) -> None:
        if self.started_at is not None:
            self.seconds = time.perf_counter() - self.started_at
        on_done, self._on_done = self._on_done, None
        with self._lock:  # a finished batch lets go of its jobs: they hold views of registered memory
            self._jobs, self._next = [], 0
        try:
            if on_done is not None:
                on_done(self)
        except BaseException as e:  # on a copy thread: it must not die of it
            self.failure = self.failure or e
        finally:
            self._unfinished.release()

    @property
    def done(self) -> bool:
        # (may read False for an instant after the end, while a waiter holds the latch on its way through)
        return not self._unfinished.locked()

    def wait(self, help: bool = True) -> None:
        """Return when every job has run (helping with them, with ``help``);
        raise the first failure."""
        if help:
            self.drain()
        with self._unfinished:  # taken once released; handed straight back for any other waiter
            pass
        if self.failure is not None:
            raise self.failure


def _unless(cancel: threading.Event, job: Job) -> None:
    if cancel.is_set():
        raise ConnectionAbortedError("read abandoned")
    job()


class CopyThreads:
    """``threads`` long-lived threads taking batches from one queue. A job
    on one of them that calls ``run`` runs its jobs inline (a thread waiting
    for its own pool could wait forever); after ``close`` the caller runs
    everything."""

    def __init__(self, threads: int = 2, parallel_min_bytes: int = PARALLEL_MIN_BYTES, *, nice: int | None = None,
                 name: str = "kvd-copy") -> None:
        self.threads = max(1, threads)
        self.parallel_min_bytes = max(1, parallel_min_bytes)
        self.nice = nice  # the threads' nice value (thread_nice: a bulk lane's copies yield the CPU); None: the creator's
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against close
        self._closed = False
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(self.threads)]
        for w in self._workers:
            w.start()

    def _work(self) -> None:
        _on_worker.yes = True
        if self.nice is not None:
            set_thread_nice(self.nice)
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            batch.drain()
            del batch  # not kept while this thread waits for the next: its jobs hold views of registered memory

    def submit(self, jobs: Sequence[Job], on_done: Callable[[Batch], None] | None = None, *, helpers: int | None = None) -> Batch:
        """Queue ``jobs`` for the threads and return at once; ``on_done`` runs
        on the thread that finishes the batch. ``helpers``: how many threads
        to call on (default: one per job, up to all of them)."""
        batch = Batch(jobs, on_done)
        wanted = min(self.threads, len(jobs)) if helpers is None else min(self.threads, helpers)
        with self._lock:
            inline = self._closed or getattr(_on_worker, "yes", False)
            if not inline:
                for _ in range(wanted):
                    self._queue.put(batch)
        if inline:
            batch.drain()
        return batch

    def run(self, jobs: Sequence[Job]) -> None:
        """Run ``jobs`` on the calling thread and the copy threads; return
        when all are done, raising the first failure."""
        if self.threads == 1 or len(jobs) <= 1:
            Batch(jobs).wait()
            return
        self.submit(jobs, helpers=len(jobs) - 1).wait(help=True)

    def submit_copies(self, copies: Sequence[Copy], on_done: Callable[[Batch], None] | None = None,
                      cancel: threading.Event | None = None) -> Batch:
        """A relayout's strided copies, cut so every thread has a share, queued
        (run here, when smaller than ``parallel_min_bytes``). With ``cancel``,
        each copy starts only while it is clear."""
        parts = split_copies(copies, self.threads, self.parallel_min_bytes)
        jobs = [c.run if cancel is None else functools.partial(_unless, cancel, c.run) for c in parts]
        if sum(c.nbytes for c in parts) < self.parallel_min_bytes:
            # Handing it over would cost more than it takes (a Mamba state
            # segment of 145 KB copies in ~50 us; a wake-up is as long).
            batch = Batch(jobs, on_done)
            batch.drain()
            return batch
        return self.submit(jobs, on_done)

    def run_copies(self, copies: Sequence[Copy]) -> None:
        """A relayout's strided copies, cut so every thread has a share."""
        self.run([c.run for c in split_copies(copies, self.threads, self.parallel_min_bytes)])

    def close(self) -> None:
        """Let the threads finish what is queued, then stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._workers:
                self._queue.put(None)
