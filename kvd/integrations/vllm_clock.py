"""When each engine step's forward ended, as P's workers saw it, for P's
scheduler: the start of ``kvd_publish_delay_seconds``.

The scheduler publishes a finished prefill from ``request_finished``, which
vLLM calls while it takes in the step's output: after the forward ended, the
output crossed from the workers and the scheduler got to the request. The
scheduler itself never sees the forward end, so each worker stamps it (in
``wait_for_save``, vLLM's hook at the end of the forward) into a small file
in shared memory, by step, and the scheduler reads the stamp of the step that
computed the prompt. The latest rank to end (the forward's end) wins.

On a GPU the stamp is taken once the device got there (``AfterDevice``),
not when the forward was only enqueued. A ring of the last ``RING`` steps per
rank: under async scheduling the step that computed a prompt is not the
newest one.

What it cannot see: a worker on another host (a multi-node engine) cannot
open the file and stamps nothing, so a pipeline stage there that ends later
is missed and the delay is under-counted; ranks that share a (TP, PP) slot
(context parallelism) keep the last one's stamp.

The scheduler removes the file's name as soon as every rank has mapped it
(each has stamped a step), or a few steps after it was made where some never
will: an engine that exits any way, SIGKILL too, leaves nothing behind.
vLLM's engine process ends with ``os._exit``, which runs no ``atexit``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np

RING = 256  # steps kept per rank
_SLOT = 2  # int64 each: (step, end in Unix ns)


def _folder() -> str:
    """Shared memory where there is one (the workers' processes see it), else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ForwardClock:
    """``ranks`` x ``RING`` slots of (step, forward end in ns) in a mapped file."""

    def __init__(self, path: str, slots: np.ndarray, owner: bool) -> None:
        self.path = path
        self._slots = slots  # (ranks, RING, 2) int64, mapped
        self.linked = owner  # the scheduler's copy, whose name for the file still exists

    @classmethod
    def create(cls, ranks: int) -> ForwardClock:
        """The scheduler's: a new file for ``ranks`` workers (its name removed by ``unlink`` or ``close``)."""
        shape = (max(1, ranks), RING, _SLOT)
        fd, path = tempfile.mkstemp(prefix=f"kvd-forward-clock-{os.getpid()}-", dir=_folder())
        try:
            # Its pages now: tmpfs grants a sparse file and kills the first
            # writer to a page past its limit with SIGBUS; this fails cleanly.
            os.posix_fallocate(fd, 0, int(np.prod(shape)) * 8)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(path, np.memmap(path, dtype=np.int64, mode="r+", shape=shape), owner=True)

    @classmethod
    def open(cls, path: str) -> ForwardClock | None:
        """A worker's view of the scheduler's file; None where it cannot be
        mapped (another host, a file the scheduler already removed)."""
        try:
            size = Path(path).stat().st_size
            ranks = size // (RING * _SLOT * 8)
            if not ranks or size != ranks * RING * _SLOT * 8:
                return None
            return cls(path, np.memmap(path, dtype=np.int64, mode="r+", shape=(ranks, RING, _SLOT)), owner=False)
        except (OSError, ValueError):
            return None

    def stamp(self, rank: int, step: int, end_ns: int) -> None:
        """Rank ``rank``'s forward of ``step`` ended at ``end_ns``. The time
        first, then the step: a reader that sees the step sees its time."""
        if not 0 <= rank < self._slots.shape[0]:
            return
        slot = self._slots[rank, step % RING]
        slot[1] = end_ns
        slot[0] = step

    def ended(self, step: int) -> int:
        """When the forward of ``step`` ended on its last rank to end (Unix
        ns); 0 where no rank stamped it (or the ring moved past it)."""
        slots = self._slots[:, step % RING]
        # The step, then the time, then the step again: a writer stores the
        # time first, so a slot whose step reads the same both times holds
        # that step's time (and not one rewritten RING steps later meanwhile).
        before = slots[:, 0].copy()
        ends = slots[:, 1].copy()
        mine = (before == step) & (slots[:, 0] == step)
        return int(ends[mine].max()) if mine.any() else 0

    def all_stamped(self) -> bool:
        """Every rank has stamped a step: each has mapped the file, and needs its name no more."""
        return bool((self._slots[:, :, 0].max(axis=1) > 0).all())

    def unlink(self) -> None:
        """Remove the file's name (the scheduler's copy); every mapping of it stays good."""
        if self.linked:
            self.linked = False
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def close(self) -> None:
        """Unmap; the scheduler's copy also removes the file."""
        self.unlink()
        mm = getattr(self._slots, "_mmap", None)
        self._slots = np.zeros((0, RING, _SLOT), dtype=np.int64)
        if mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                mm.close()
