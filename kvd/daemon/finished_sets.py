"""Finished sets: each worker's box of outcomes, and the engine's merged sets.

A pull or a publication that ends is an ``Outcome`` of one rank. It goes
into that rank's box (``GetFinished``/``WatchFinished`` drain it) and to the
engine's aggregation: the ``EngineFinishedHub`` here, or, where the engine
aggregates on another node's daemon, that daemon through
``AggregatorReports``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvd.core.aggregate import EngineFinishedHub, Outcome, WorkerFinished
from kvd.core.leases import Ended, RankKey
from kvd.daemon.metrics import Metrics
from kvd.daemon.registration import Registration
from kvd.daemon.reports import AggregatorReports


class FinishedSets:
    def __init__(self, metrics: Metrics, reports: AggregatorReports) -> None:
        self._metrics = metrics
        self.reports = reports  # to (or, as the aggregator, from) the other nodes' daemons
        self._aggregator_address = reports.aggregator_address
        self.own_address = ""  # this daemon's gRPC address: set once the server is bound
        self.boxes: dict[RankKey, WorkerFinished] = {}  # outlive registrations
        self.engine_hub = EngineFinishedHub()
        self._expected_override = 0
        self.last_outcome_at = float("-inf")  # monotonic time of the newest outcome

    @property
    def _forwarding(self) -> bool:
        return bool(self._aggregator_address) and self._aggregator_address != self.own_address

    def rank_joined(self, reg: Registration) -> None:
        """A stream the old registration of this rank opened sees it was replaced and ends."""
        self.boxes.setdefault((reg.worker.tp_rank, reg.worker.pp_rank), WorkerFinished()).wake()
        count = self._expected_override or reg.worker.tp_size * reg.worker.pp_size
        if count != self.engine_hub.expected:  # only a new engine changes it: every rank has the engine's world
            self.engine_hub.new_engine(count)

    def rank_ended(self, rank: RankKey, _reason: str) -> None:
        """Its WatchFinished streams end."""
        if box := self.boxes.get(rank):
            box.wake()

    def box(self, rank: RankKey) -> WorkerFinished:
        return self.boxes[rank]

    def emit(self, rank: RankKey, outcome: Outcome, invalid: Sequence[int] = ()) -> None:
        """A worker's outcome: into its own box, and to the engine's aggregator."""
        self.last_outcome_at = time.monotonic()
        box = self.boxes.setdefault(rank, WorkerFinished())
        box.add(outcome, invalid)
        if dropped := box.bound():  # almost never: skip the label lookup on every outcome
            self._metrics.unread_dropped.labels("worker").inc(dropped)
        if self._forwarding:
            self.reports.queue(rank, outcome, invalid)
        else:
            one = WorkerFinished()
            one.add(outcome, invalid)
            self.report_to_hub(one)

    def report_sending(self, ended: Ended) -> None:
        """A publication of this rank ended: its outcome on the sending side."""
        self.emit(ended.rank, Outcome(ended.request_id, "sending", ended.outcome, ended.reason))
        if ended.outcome == "expired":
            self._metrics.leases_expired.inc()

    def report_to_hub(self, output: WorkerFinished) -> None:
        self._to_hub(lambda: self.engine_hub.report(output))

    def _to_hub(self, deliver: Callable[[], object]) -> None:
        """Deliver to the engine's hub, counting what it drops unread."""
        before = self.engine_hub.dropped
        deliver()
        if self.engine_hub.dropped > before:
            self._metrics.unread_dropped.labels("engine").inc(self.engine_hub.dropped - before)

    def set_expected(self, count: int, world: int) -> int:
        """vLLM's expected finished count (0: the engine's world size); a
        request the new count completes is delivered now."""
        self._expected_override = count
        self._to_hub(lambda: self.engine_hub.set_expected(count or world))
        return self.engine_hub.expected

    @property
    def unsent(self) -> bool:
        """Outcomes not yet read by their worker, or not yet reported to the aggregator."""
        return self.reports.pending or any(b.sending or b.recving for b in self.boxes.values())

    def end_streams(self) -> None:
        """Every push stream sends what is left and ends."""
        for box in self.boxes.values():
            box.wake()
        for notify in list(self.engine_hub.subscribers):
            notify(WorkerFinished())  # empty: the stream's cue to end
