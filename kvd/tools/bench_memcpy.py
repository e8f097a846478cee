"""The memcpy baseline, with the resources kvd's copies get.

kvd copies on ``copy_threads`` threads (the daemon's copy threads, or
``process_vm_readv`` split over them), so "kvd / memcpy" compares with the
best memcpy on any number of threads from one to the machine's cores, on
the same bytes and pages: each thread copies one contiguous share of the
buffers with torch's ``copy_`` (which releases the GIL), and the fastest
count wins. On this project's 2-core machine one thread ran at 5.8-7.5
GB/s and two at 17-21; a one-thread baseline flattered anything that copies
on two.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time

import torch


class BestMemcpy:
    """Times ``dst.copy_(src)`` cut over 1..``max_threads`` threads."""

    def __init__(self, nbytes: int, max_threads: int | None = None) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        self.dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
        self.max_threads = max(1, max_threads or os.cpu_count() or 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_threads, thread_name_prefix="memcpy")
        self.threads = 1  # the count of the best try so far

    def seconds(self, threads: int) -> float:
        """One timed copy of every byte, cut into ``threads`` contiguous shares."""
        n = self.src.numel()
        bounds = [n * i // threads for i in range(threads + 1)]
        t0 = time.perf_counter()
        if threads == 1:
            self.dst.copy_(self.src)
        else:
            futures = [self._pool.submit(self.dst[lo:hi].copy_, self.src[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
            for f in futures:
                f.result()
        return time.perf_counter() - t0

    def best_seconds(self) -> float:
        """The fastest of one copy on each thread count (remembered in ``threads``)."""
        best = float("inf")
        for k in range(1, self.max_threads + 1):
            s = self.seconds(k)
            if s < best:
                best, self.threads = s, k
        return best

    def close(self) -> None:
        self._pool.shutdown(wait=True)
