"""The one background thread that unmaps memory (``kvd-unmap``).

Unmapping costs about 25 ms a GiB, too long for an event loop, so regions
are closed here, off the caller's thread (``close_later``). A shared-memory
mapping that views still hold cannot be unmapped yet (an unmap under a view
in use would kill the daemon with SIGSEGV): it waits here too
(``unmap_when_unviewed``) and is unmapped once its last view has gone,
tried after each close and every ``UNVIEWED_POLL_SECONDS`` while any waits,
never on the thread that dropped the view. At exit the closes queued are
run (one may unlink a gone worker's files) before the interpreter goes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import queue
import threading
from collections.abc import Callable

UNVIEWED_POLL_SECONDS = 0.5
EXIT_WAIT_SECONDS = 30.0  # at exit, the closes queued get this long; a stuck one does not keep the process

_STOP = object()
_jobs: queue.SimpleQueue[Callable[[], None] | mmap.mmap | object] = queue.SimpleQueue()
_lock = threading.Lock()
# Held while the thread tries the mappings views held: a test holds it to
# see what dropping a view does by itself (nothing: the mapping waits here).
retrying = threading.Lock()
_thread: threading.Thread | None = None
_pending = 0  # mappings handed to unmap_when_unviewed and not yet unmapped


def close_later(close: Callable[[], None]) -> None:
    """Run ``close`` (unmapping regions) on the unmapping thread. The memory
    stays valid until then, and while any view of it lives."""
    _submit(close)


def unmap_when_unviewed(mm: mmap.mmap) -> None:
    """Unmap ``mm`` once no view of it is left."""
    global _pending
    with _lock:
        _pending += 1
    _submit(mm)


def unmaps_pending() -> int:
    """Mappings waiting for their last view to go."""
    with _lock:
        return _pending


def _submit(job: Callable[[], None] | mmap.mmap) -> None:
    global _thread
    _jobs.put(job)
    with _lock:
        if _thread is None or not _thread.is_alive():
            thread = threading.Thread(target=_run, name="kvd-unmap", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # the interpreter is ending: the process's end unmaps everything
                return
            if _thread is None:
                atexit.register(_finish)
            _thread = thread


def _finish() -> None:
    """At exit: run the closes queued, then stop (mappings views still hold are left to the process's end)."""
    with _lock:
        thread = _thread
    if thread is not None and thread.is_alive():
        _jobs.put(_STOP)
        thread.join(EXIT_WAIT_SECONDS)


def _run() -> None:
    global _pending
    viewed: list[mmap.mmap] = []  # this thread's own
    while True:
        try:
            job = _jobs.get(timeout=UNVIEWED_POLL_SECONDS if viewed else None)
        except queue.Empty:
            job = None
        if job is _STOP:
            return
        if isinstance(job, mmap.mmap):
            viewed.append(job)
        elif callable(job):
            try:
                job()
            except BaseException:  # nothing a close raises may end the thread every later close needs
                logging.getLogger("kvd.regions").exception("closing mapped regions failed")
        job = None  # not held while waiting for the next: a failed close's regions would stay mapped
        with retrying:
            for mm in viewed:
                with contextlib.suppress(BufferError):
                    mm.close()
        unmapped = sum(mm.closed for mm in viewed)
        if unmapped:
            viewed = [mm for mm in viewed if not mm.closed]
            with _lock:
                _pending -= unmapped
