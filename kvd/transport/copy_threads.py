"""The daemon's copy threads: one request's copies on every core.

A relayout (layout, block size, head slice) and a same-host copy are memory
passes that one thread runs at about half of what the node's memory gives
(a strided copy of 256-byte head rows: 0.5x a one-thread memcpy on this
project's 2-core machine; on two threads 0.95x). torch's ``copy_``,
``memcpy`` and ``process_vm_readv`` all drop the GIL, so plain threads run
them in parallel; torch's own intra-op pool stays at one thread because its
OpenMP workers spin between ops and take cores from the sockets.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from kvd.core.relayout import Copy, split_copies

_on_helper = threading.local()


def _mark_helper() -> None:
    _on_helper.yes = True


# Below this a copy stays whole: handing it to a helper costs more than the
# helper saves (a thread wake-up is tens of us; 1 MiB copies in ~100 us).
PARALLEL_MIN_BYTES = 1 << 20


class CopyThreads:
    """Runs jobs on the calling thread and ``threads - 1`` helpers, each
    taking the next job, and returns when all are done. After a failure no
    job starts; the first failure is raised once every running job has
    stopped. A job running on a helper that calls ``run`` runs its jobs
    inline (a helper waiting for a helper could wait forever)."""

    def __init__(self, threads: int = 2, parallel_min_bytes: int = PARALLEL_MIN_BYTES) -> None:
        self.threads = max(1, threads)
        self.parallel_min_bytes = max(1, parallel_min_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.threads - 1), thread_name_prefix="kvd-copy",
                                                           initializer=_mark_helper)

    def run(self, jobs: Sequence[Callable[[], object]]) -> None:
        if self.threads == 1 or len(jobs) <= 1 or getattr(_on_helper, "yes", False):
            for job in jobs:
                job()
            return
        lock = threading.Lock()
        todo = iter(jobs)
        failed: list[BaseException] = []

        def drain() -> None:
            while True:
                with lock:
                    job = None if failed else next(todo, None)
                if job is None:
                    return
                try:
                    job()
                except BaseException as e:
                    with lock:
                        failed.append(e)
                    return

        helpers = []
        for _ in range(min(self.threads, len(jobs)) - 1):
            try:
                helpers.append(self._pool.submit(drain))
            except RuntimeError:  # closing: the caller runs them all
                break
        drain()
        # Every job has started by now: a helper not yet running (its thread
        # busy with another landing's share) has nothing left, so it is
        # cancelled rather than waited for.
        concurrent.futures.wait([h for h in helpers if not h.cancel()])
        if failed:
            raise failed[0]

    def run_copies(self, copies: Sequence[Copy]) -> None:
        """A relayout's strided copies, cut so every thread has a share."""
        self.run([c.run for c in split_copies(copies, self.threads, self.parallel_min_bytes)])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
