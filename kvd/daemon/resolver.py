"""D resolves params made before P published (vLLM's scheduler's, a proxy
that dispatches P and D at once): ``Peer.Resolve`` waits on P for the
publication and answers its generation, epoch and lease."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvd.core import errors
from kvd.core.errors import DeadlineExceeded, PermissionDenied, ResourceExhausted, Unavailable
from kvd.core.requests import TransferParams
from kvd.daemon.active_pull import ActivePull
from kvd.daemon.outbound import PeerChannels

log = logging.getLogger("kvd.daemon")

RETRY_SECONDS = 1.0  # a queued pull tries at most this often


class Resolver:
    def __init__(self, channels: PeerChannels, wait_seconds: float, queued_at_once: int) -> None:
        self.channels = channels
        self.wait_seconds = wait_seconds  # publish_wait_seconds: how long P waits for the publication
        self._queued = asyncio.Semaphore(queued_at_once)

    async def resolve(self, params: TransferParams) -> TransferParams:
        """``params`` with what P resolved: the generation (and epoch; the
        blocks, if none were known; ``stream``; the lease P holds)."""
        t0 = time.monotonic()
        try:
            resolution = await self.channels.resolve(params.remote_address, params.remote_engine_id, params.request_id,
                                                     params.capability, self.wait_seconds, timeout=self.wait_seconds + 10)
        except grpc.aio.AioRpcError as e:
            raise errors.from_code(e.code().name, f"resolving request_id={params.request_id!r} on {params.remote_address} "
                                   f"(after {time.monotonic() - t0:.1f}s): {e.details()}") from None
        return params.resolved(resolution)

    async def while_queued(self, active: ActivePull) -> None:
        """Resolve a queued pull's params while it waits for a slot: P's lease
        has run since it published, and the heartbeat renews a known
        generation only. Tried again while it queues (P not published yet:
        each try waits for it; P busy or away: a second later); an answer
        that will not change (the publication ended, bad params) is left to
        the pull's own resolve, which reports it once the pull has its slot.
        At most ``queued_at_once`` at once (``max_concurrent_pulls``), so
        queued pulls hold no more of P's pending resolves than running ones
        (past that, P refuses resolves, and a pull with its slot would fail);
        so a queue of pulls P has not published yet can hold the others'
        tries back by a resolve's wait a round (10 s by default, against a
        lease of 120 s)."""
        rid = active.request.request_id
        while active.progress.phase == "queued":
            t0 = time.monotonic()
            try:
                async with self._queued:
                    resolved = await self.resolve(active.params)
            except PermissionDenied:  # not published within the wait (none, where a side's publish_wait_seconds is 0)
                await asyncio.sleep(max(0.0, RETRY_SECONDS - (time.monotonic() - t0)))
                continue
            except (Unavailable, ResourceExhausted, DeadlineExceeded, OSError) as e:
                log.debug("resolving queued pull request_id=%s: %s; again in %g s", rid, e, RETRY_SECONDS)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            except Exception as e:  # its own resolve, with its slot, reports what this was
                log.debug("resolving queued pull request_id=%s failed (the pull resolves again): %s", rid, e)
                return
            if not active.params.generation:
                active.params = resolved
                active.next_renew = time.monotonic()  # renewed at the next heartbeat
            return
