"""Prometheus metrics. Every name is kvd_*, units in the name, no request ids."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvd import __version__

# From 100 us (a 16-block same-host request) to 30 s (a long prompt on a slow link).
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

PULL_PHASES = ("queued", "resolve", "handshake", "plan", "transfer", "verify", "report")  # kvd_pull_phase_seconds{phase}


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.bytes_sent = Counter("kvd_sent_bytes", "KV bytes sent on the data plane", ["transport"], registry=r)
        self.bytes_received = Counter("kvd_received_bytes", "KV bytes received on the data plane", ["transport"], registry=r)
        self.blocks_sent = Counter("kvd_sent_blocks", "Remote blocks served (per segment and layer chunk)", ["transport"], registry=r)
        self.blocks_received = Counter("kvd_received_blocks", "Local blocks filled by completed pulls", ["transport"], registry=r)
        self.transfer_seconds = Histogram("kvd_transfer_duration_seconds", "Pull duration, accepted to landed", ["outcome"], buckets=DURATION_BUCKETS, registry=r)
        self.pulls_in_flight = Gauge("kvd_pulls_in_flight", "Pulls accepted and not yet ended", registry=r)
        self.bytes_in_flight = Gauge("kvd_pull_bytes_in_flight", "Bytes planned by pulls not yet ended", registry=r)
        self.unread_dropped = Counter("kvd_finished_unread_dropped", "Finished outcomes forgotten unread past 65536 a direction: "
                                      "a worker's box nobody reads (box=worker), the engine's (box=engine), "
                                      "or reports queued for an unreachable aggregator daemon (box=aggregator)", ["box"], registry=r)
        for box in ("worker", "engine", "aggregator"):  # scraped as 0 from the start, though incremented only on a drop
            self.unread_dropped.labels(box)
        self.repeated_reports = Counter("kvd_finished_reports_repeated", "Reports from another rank's daemon applied before and not counted again "
                                        "(sent again after their answer was lost)", registry=r)
        self.handshakes = Counter("kvd_handshakes", "Handshakes by role and result", ["role", "result"], registry=r)
        self.handshake_seconds = Histogram("kvd_handshake_duration_seconds", "Handshake duration as the caller", buckets=DURATION_BUCKETS, registry=r)
        self.failures = Counter("kvd_pull_failures", "Failed pulls by reason", ["reason"], registry=r)
        self.verify_digests = Counter("kvd_verify_digests", "Published ranks digested for readers to verify against (owner side)", registry=r)
        self.verify_checks = Counter("kvd_verify_checks", "Landed reads checked against the owner's digest, by result (ok, mismatch, unverified)", ["result"], registry=r)
        self.verify_digest_seconds = Histogram("kvd_verify_digest_seconds", "An owner's digest of one publication, every rank (before it is published)",
                                               buckets=DURATION_BUCKETS, registry=r)
        self.qos_wait_seconds = Histogram("kvd_qos_wait_seconds", "How long a read's chunk waited for the wire (--qos on), by class",
                                          ["priority"], buckets=DURATION_BUCKETS, registry=r)
        self.qos_bytes = Counter("kvd_qos_bytes", "Bytes granted the wire (--qos on), by class and tenant", ["priority", "tenant"], registry=r)
        self.verify_mismatches = Counter("kvd_verify_mismatches", "Local blocks failed because what landed differs from what the owner published", registry=r)
        self.data_reads = Counter("kvd_data_reads", "Data-plane reads sent (one per remote rank, or one per stripe of a striped read)", ["transport"], registry=r)
        self.refused_reads = Counter("kvd_refused_reads", "Data-plane reads refused, by reason", ["reason"], registry=r)
        self.leases_held = Gauge("kvd_leases_held", "Publications holding blocks", registry=r)
        self.readers = Gauge("kvd_readers", "Reader daemons (engine, epoch) handshaken with this daemon as their owner, not yet forgotten", registry=r)
        self.pinned_ranks = Gauge("kvd_pinned_ranks", "Published ranks a same-host or NIXL reader is copying; their end waits for it", registry=r)
        self.leases_expired = Counter("kvd_leases_expired", "Publications that ended by lease expiry", registry=r)
        self.reader_releases = Counter("kvd_reader_releases", "Published ranks ended early by their reader (it failed, aborted, or did not need them)", registry=r)
        self.window_skipped = Counter("kvd_window_skipped_bytes", "KV bytes a pull did not move because its group needs only a window (sliding window, chunked local) where full attention would move every token", ["kind"], registry=r)
        self.layers_saved = Counter("kvd_stream_layers_saved", "Layers streaming prefill workers said saved, per request and rank (each counted once, in whatever order the calls arrive)", registry=r)
        self.layer_save_reports = Counter("kvd_stream_layer_save_reports", "LayersSaved reports received, one per request and call (a streaming prefill reports each layer, then its step's end)", registry=r)
        self.layer_wait_seconds = Counter("kvd_stream_layer_wait_seconds", "Time data-plane reads spent waiting for prefill to save a layer", registry=r)
        self.regions = Gauge("kvd_registered_regions", "Mapped memory regions", registry=r)
        self.region_bytes = Gauge("kvd_registered_bytes", "Bytes of mapped memory regions", registry=r)
        self.relayout_seconds = Counter("kvd_relayout_seconds", "Time spent landing (relaying out) received segments", registry=r)
        # Honest throughput: rate(kvd_received_bytes_total) / rate(kvd_transfer_active_seconds_total)
        # divides by the wall time during which any pull was active, not by
        # the sum of overlapping durations (which under-reports by the concurrency).
        self.active_seconds = Counter("kvd_transfer_active_seconds", "Wall time during which at least one pull was in flight", registry=r)
        self.pull_phase_seconds = Histogram("kvd_pull_phase_seconds", "Where D's pulls spend their time, by phase: queued (for a pull slot), "
                                            "resolve (params made before P published), handshake, plan, transfer (the data plane, "
                                            "bytes moved and landed), verify (checking what landed against the owner's digest), report (landed to the worker's finished set)", ["phase"],
                                            buckets=DURATION_BUCKETS, registry=r)
        for phase in PULL_PHASES:  # scraped from the start, as 0
            self.pull_phase_seconds.labels(phase)
        self.read_serve_seconds = Histogram("kvd_read_serve_seconds", "P serving one TCP read: its READ frame in, authorised, to its END out",
                                            buckets=DURATION_BUCKETS, registry=r)
        self.event_loop_lag = Histogram("kvd_event_loop_lag_seconds", "How long the daemon's event loop took to run a ping sent every "
                                        "half second: every control call waits behind a blocked loop", buckets=DURATION_BUCKETS, registry=r)
        self.background_errors = Counter("kvd_background_errors", "Background loops (lease expiry, heartbeat, reports, reaper, idle peers) "
                                         "that raised and were started again: each is logged with its traceback", ["loop"], registry=r)
        self.publish_delay_seconds = Histogram(
            "kvd_publish_delay_seconds", "From the end of the forward that computed a prompt (the engine's stamp) to its publication here, "
            "by who published it: the engine's scheduler for every rank (engine), or a worker for its rank (worker)", ["by"],
            buckets=DURATION_BUCKETS, registry=r)
        for by in ("engine", "worker"):  # scraped from the start, as 0
            self.publish_delay_seconds.labels(by)
        self.build = Info("kvd_build", "kvd build information", registry=r)
        self.build.info({"version": __version__})


class ActiveClock:
    """Accumulates wall time while at least one transfer is active."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.active = 0
        self.since = 0.0
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self.active == 0:
                self.since = time.perf_counter()
            self.active += 1

    def stop(self) -> None:
        with self._lock:
            self.active -= 1
            if self.active == 0:
                self.counter.inc(time.perf_counter() - self.since)
