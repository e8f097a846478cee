"""A stalled event loop, seen from outside it.

Every control RPC, every ACK and every finished set runs on the daemon's one
event loop. A handler that blocks it stalls them all, and from a peer that
looks like calls timing out for no reason. A thread pings the loop every
``interval`` seconds: each ping's wait goes into ``kvd_event_loop_lag_seconds``,
and a ping still unanswered after ``warn_after`` seconds is logged once, with
where the loop's thread is stuck, and again when the loop runs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import Any

log = logging.getLogger("kvd.daemon")

STACK_FRAMES = 12  # the innermost frames: where it blocks, and who called


class LoopWatchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, lag: Any, *, interval: float = 0.5, warn_after: float = 1.0) -> None:
        self.loop, self.lag, self.interval, self.warn_after = loop, lag, interval, warn_after
        self._stop = threading.Event()
        self._loop_thread: int | None = None
        self._thread = threading.Thread(target=self._run, name="kvd-loop-watchdog", daemon=True)

    def start(self) -> None:
        """Call on the loop's own thread: that is the thread a stall's stack is taken from."""
        self._loop_thread = threading.get_ident()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # not joined: the thread ends within ``interval`` on its own

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            answered = threading.Event()
            sent = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop closed
                return
            warned = False
            while not answered.wait(self.interval if warned else self.warn_after):
                if self._stop.is_set():
                    return
                if not warned:
                    warned = True
                    log.warning("event loop blocked for %.1fs; it is in:\n%s", time.monotonic() - sent, self._where())
            waited = time.monotonic() - sent
            self.lag.observe(waited)
            if warned:
                log.warning("event loop ran again after %.1fs", waited)

    def _where(self) -> str:
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "  (its thread is gone)"
        return "".join(traceback.format_stack(frame)[-STACK_FRAMES:]).rstrip()
