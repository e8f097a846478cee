"""The daemon's background loops, kept running.

Leases expire, pulls' leases are renewed, finished outcomes reach the
aggregator, dead workers' memory is let go of and idle peers are forgotten,
each by a loop that runs for the daemon's life. A loop that raised would end
its task with the exception kept in the task object, unseen: the daemon
would go on answering while, say, no lease ever expired again. So each runs
under ``keep_running``: an exception is logged with its traceback, counted
(``kvd_background_errors_total{loop}``), and the loop starts again after a
pause. The loops keep their state on their objects, so a restart loses
nothing but the tick that failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("kvd.daemon")

RESTART_SECONDS = 1.0  # a loop that keeps failing logs once a second, not in a tight loop


async def keep_running(name: str, run: Callable[[], Awaitable[None]], on_error: Callable[[str], None],
                       pause: float = RESTART_SECONDS) -> None:
    """Run ``run`` (a loop meant never to end) again whenever it raises or ends, until cancelled."""
    while True:
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background loop %r failed; it starts again in %gs", name, pause)
        else:
            log.error("background loop %r ended; it starts again in %gs", name, pause)
        on_error(name)
        await asyncio.sleep(pause)
