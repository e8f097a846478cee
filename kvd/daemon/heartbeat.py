"""D keeps P's leases alive while its pulls are queued or run.

Every pull whose params are resolved is renewed at the heartbeat after D
accepts it (or resolves them, which a queued pull does while it waits, and
which tells D the lease P holds): P's lease has run since P published, and the
params took their time through P's engine, the scheduler and D's engine.
Then three times a lease, batched per owner engine. A renewal P answers
"gone" (expired, aborted, or read by the sibling rank a replica copies
from) ends that pull's renewals. It fails the pull only while it is queued
and reads P itself: nothing has landed then, and waiting for a slot to be
refused would only be slower. A pull that copies from a replica, or is
already reading, is left to its read, as only the read knows whether it
still needs P, and a cancel racing a read's end would fail a pull whose
every block landed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import grpc

from kvd.core.leases import DEFAULT_LEASE_SECONDS, RankKey
from kvd.core.requests import LeaseRef, TransferParams
from kvd.daemon.active_pull import ActivePull
from kvd.daemon.outbound import PeerChannels, Tasks

log = logging.getLogger("kvd.daemon")

TICK_SECONDS = 0.1


class Heartbeat:
    def __init__(self, engine_id: str, pulls: Mapping[tuple[RankKey, str], ActivePull], channels: PeerChannels, tasks: Tasks,
                 reads_p: Callable[[ActivePull], bool]) -> None:
        self.engine_id = engine_id
        self.pulls = pulls  # the puller's own, read each beat
        self.channels = channels
        self.tasks = tasks
        self.reads_p = reads_p  # False: a replica rank copies from its sibling instead

    async def run(self) -> None:
        """Renew P's leases for every pull queued or in flight, batched per peer."""
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.beat(time.monotonic())

    def beat(self, now: float) -> None:
        """One beat: a renewal per owner engine for the pulls due. Its own
        function, not run's loop body, so that its lists of pulls die with it:
        a loop variable left in run's frame kept the last beat's pulls, and
        with them their registrations' memory, until another renewal."""
        due: dict[tuple[str, str], list[ActivePull]] = {}
        for p in self.pulls.values():
            # Unresolved params name no generation to renew: a queued pull resolves them while it
            # waits (Resolver.while_queued), and is renewed from then on, by P's own lease.
            if now >= p.next_renew and p.params.generation and not p.lease_gone:
                p.next_renew = now + renew_interval(p.params)
                # One call per owner engine: a daemon refuses leases it is not the engine of.
                due.setdefault((p.params.remote_address, p.params.remote_engine_id), []).append(p)
        for (address, _engine), pulls in due.items():
            self.tasks.spawn(self._renew(address, pulls))

    async def _renew(self, address: str, pulls: list[ActivePull]) -> None:
        leases = [LeaseRef(p.params.request_id, p.params.generation, p.params.capability) for p in pulls]
        try:
            alive = await self.channels.renew(address, pulls[0].params.remote_engine_id, self.engine_id, leases, timeout=5)
        except grpc.aio.AioRpcError as e:
            log.info("lease heartbeat to %s failed: %s", address, e.code().name)
            return  # the pull itself will find out
        for p, ok in zip(pulls, alive, strict=False):
            if not ok:
                p.lease_gone = True
                if p.progress.phase == "queued" and self.reads_p(p):
                    p.cancel(f"publication of request_id={p.params.request_id!r} expired or ended on the prefill side")


def renew_interval(params: TransferParams) -> float:
    """Three times per lease, so one lost beat does not lose the lease."""
    lease = params.lease_seconds if params.lease_seconds > 0 else DEFAULT_LEASE_SECONDS
    return max(0.05, lease / 3)
