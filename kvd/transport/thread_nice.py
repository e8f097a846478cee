"""Bulk reads yield the CPU to interactive ones (``--qos on``, ``qos_bulk_nice``).

The wire's order decides which chunk moves next, but on a host with few
cores the bulk reads' own sends, receives and copies still take the CPU the
interactive read needs for its own. On 2 cores, small interactive pulls
beside two bulk pulls had 2.6-4.0x their idle p99 with every thread at one
priority, and 1.05-1.4x with the bulk threads at nice 10 (``kvd bench
--sections qos``), which gives such a thread about a tenth of a nice-0
thread's turn at a busy core: the bulk pulls still take every cycle the
interactive path leaves.

A thread may raise its own nice value without privilege, but lowering it
again needs CAP_SYS_NICE, which a container seldom has; so a thread that
moves bulk reads stays niced, and so does every thread it starts (a thread
inherits its creator's nice). A reader with a bulk nice runs its bulk
reads, their landings and their copies on threads of their own, on
connections of their own that its HELLO names a bulk lane; the owner nices the thread of such a connection only, so
a connection that may carry an interactive read (from a reader with qos off,
or an older one) is served at the daemon's priority.

Bulk threads yield to every thread at the daemon's priority, co-located
processes too (an engine's workers): set qos_bulk_nice 0 to keep them level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("kvd.tcp")

MAX_NICE = 19


def base_nice() -> int:
    """The calling thread's nice value (the daemon's, called at startup)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if _per_thread() else 0


def bulk_nice(base: int, increment: int) -> int:
    """The nice a bulk thread runs at: ``increment`` above the daemon's own
    (unchanged with 0, or where a thread's nice is not its own: not Linux)."""
    return min(MAX_NICE, base + increment) if increment > 0 and _per_thread() else base


def set_thread_nice(nice: int) -> bool:
    """Set the calling thread's nice value (Linux: a thread is a task of its
    own). True where it now has it; False where it could not be (lowering
    without CAP_SYS_NICE, a seccomp filter), logged once a daemon."""
    global _warned
    if not _per_thread():
        return False
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError as e:
        if not _warned:
            _warned = True
            log.warning("a data-plane thread keeps its CPU priority (nice %d wanted; logged once): %s", nice, e)
        return False


def _per_thread() -> bool:
    return sys.platform == "linux" and hasattr(os, "setpriority")


_warned = False  # a race between two threads logs twice at worst
