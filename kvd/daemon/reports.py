"""Finished sets of ranks whose engine aggregates on another daemon.

When an engine's ranks span nodes, one daemon (``aggregator_address``)
merges the engine's finished sets; the others report each outcome of their
ranks to it. ``AggregatorReports`` is both ends: ``queue`` and ``run`` on a
reporting daemon, ``receive`` on the aggregator.

A report is applied exactly once. The aggregator counts reports per
request, as vLLM's ``KVOutputAggregator`` does, so one applied twice would
count its rank twice and finish a request before every rank had. The
reporter numbers its reports and sends them one at a time, the same report
with the same number until one is answered (a timeout may follow an
apply); the aggregator's ``ReportLedger`` drops a number it has applied,
and records one only once it is applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvd.core.aggregate import Outcome, ReportLedger, WorkerFinished, check_outcomes
from kvd.core.errors import InvalidArgument
from kvd.core.leases import RankKey
from kvd.core.requests import FinishedReport
from kvd.core.spec import MAX_EPOCH
from kvd.daemon.metrics import Metrics
from kvd.daemon.outbound import PeerChannels
from kvd.daemon.registry import Registry

log = logging.getLogger("kvd.daemon")

# Outcomes a ReportFinished carries at most (far below gRPC's 16 MiB), and the
# answers no retry changes (auth failures are retried: the queue is bounded).
REPORT_BATCH = 4096
REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED})
RETRY_SECONDS = 0.5
MAX_SENDER_EPOCH = MAX_EPOCH


@dataclass(frozen=True)
class Report:
    rank: RankKey
    batch: WorkerFinished
    seq: int


class AggregatorReports:
    def __init__(self, aggregator_address: str, registry: Registry, metrics: Metrics, channels: PeerChannels) -> None:
        self.aggregator_address = aggregator_address
        self._registry = registry
        self._metrics = metrics
        self._channels = channels
        # Outcomes not yet reported: one box a rank, bounded like every other
        # box while the aggregator is unreachable, sent up to REPORT_BATCH at once.
        self.queued: dict[RankKey, WorkerFinished] = {}
        self.in_flight: Report | None = None  # sent, or to be sent again, until answered
        self._seq = 0
        self._wake = asyncio.Event()  # queue (always on the loop) wakes the sender
        self.ledger = ReportLedger()

    @property
    def pending(self) -> bool:
        return bool(self.queued) or self.in_flight is not None

    def queue(self, rank: RankKey, outcome: Outcome, invalid: Sequence[int]) -> None:
        box = self.queued.setdefault(rank, WorkerFinished())
        box.add(outcome, invalid)
        if dropped := box.bound():
            self._metrics.unread_dropped.labels("aggregator").inc(dropped)
        self._wake.set()

    async def run(self) -> None:
        """Send what is queued, in order, one report at a time. Woken by each
        queued outcome: polling would add its period to every finished set of
        a multi-rank engine, and wake an idle daemon for nothing."""
        if self.pending:  # started again (``keep_running``) with outcomes queued: no queue call will wake it for them
            self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                report = self.in_flight = self.in_flight or self._next()
                try:
                    await self._channels.report(self.aggregator_address, self._request(report), timeout=5)
                except grpc.aio.AioRpcError as e:
                    if e.code() not in REFUSED:
                        # Unreachable, or no answer in time (it may have applied
                        # it): the same report again, under the same number.
                        left = len(report.batch.outcomes()) + sum(len(b.sending) + len(b.recving) for b in self.queued.values())
                        log.warning("aggregator %s unreachable (%s); %d outcomes queued", self.aggregator_address, e.code().name, left)
                        await asyncio.sleep(RETRY_SECONDS)
                        continue
                    # Retrying cannot help: counted, and logged, not retried forever.
                    lost = len(report.batch.outcomes())
                    self._metrics.unread_dropped.labels("aggregator").inc(lost)
                    log.error("aggregator %s refused %d outcomes (%s): %s", self.aggregator_address, lost, e.code().name, e.details())
                except Exception as e:  # not gRPC's (a channel that cannot be made): the sender must not die of it
                    log.warning("report to aggregator %s failed (%s); retrying", self.aggregator_address, e)
                    await asyncio.sleep(RETRY_SECONDS)
                    continue
                self.in_flight = None

    def _next(self) -> Report:
        rank = next(iter(self.queued))
        box = self.queued[rank]
        batch = box.take(REPORT_BATCH)
        if box.empty:  # take moved every invalid id
            del self.queued[rank]
        self._seq += 1
        return Report(rank, batch, self._seq)

    def _request(self, report: Report) -> FinishedReport:
        return FinishedReport(self._registry.engine_id, report.rank, report.batch, self._registry.epoch, report.seq)

    def receive(self, req: FinishedReport, deliver: Callable[[WorkerFinished], None]) -> bool:
        """Another rank's daemon reports to us, the engine's aggregator: its
        outcomes go to ``deliver``. False for a report applied before (sent
        again after a lost answer)."""
        engine_id = self._registry.engine_id
        if req.engine_id != engine_id:
            raise InvalidArgument("engine_id", req.engine_id, f"is not this aggregator's engine {engine_id!r}")
        if len(req.sender_epoch) > MAX_SENDER_EPOCH:
            raise InvalidArgument("sender_epoch", req.sender_epoch, f"is longer than {MAX_SENDER_EPOCH} characters")
        sizes = self._registry.sizes()
        if sizes is not None and not (req.rank[0] < sizes[0] and req.rank[1] < sizes[1]):
            raise InvalidArgument("worker", f"tp{req.rank[0]}/pp{req.rank[1]}", f"is not a rank of engine {engine_id!r} (tp_size {sizes[0]}, pp_size {sizes[1]})")
        if len(req.finished.sending) + len(req.finished.recving) > REPORT_BATCH:
            raise InvalidArgument("details", f"<{len(req.finished.sending) + len(req.finished.recving)} outcomes>", f"are more than a report holds ({REPORT_BATCH})")
        check_outcomes("details", req.finished.outcomes())
        if self.ledger.applied(req.sender_epoch, req.seq):
            self._metrics.repeated_reports.inc()
            log.info("report %d from daemon epoch %s applied before: not counted again", req.seq, req.sender_epoch[:8])
            return False
        deliver(req.finished)  # one or many outcomes of that worker: a batch queued while we were unreachable
        self.ledger.record(req.sender_epoch, req.seq)
        return True
