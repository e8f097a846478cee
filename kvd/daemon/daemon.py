"""The daemon: the composition of one engine's sidecar.

``Daemon`` builds the parts and wires them, each given what it uses and
nothing more: the ``Registry`` (registered workers), ``FinishedSets``
(outcomes, per worker and for the engine), ``Handshakes`` (peers), the two
sides, ``Publisher`` (prefill: publications and reads of them) and
``Puller`` (decode: pulls), and the data plane's server and client. It runs
their background tasks, drains and closes them, and answers what spans
both sides (abort, status). No part holds the daemon.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from kvd.auth import AuthConfig
from kvd.core.addresses import host_port
from kvd.core.errors import InvalidArgument
from kvd.core.leases import PublicationTable
from kvd.core.qos import QosTag, WireSchedule
from kvd.core.requests import TransferParams
from kvd.core.session import Hello
from kvd.core.spec import WorkerId, check_request_id
from kvd.daemon.background import keep_running
from kvd.daemon.config import DaemonConfig
from kvd.daemon.finished_sets import FinishedSets
from kvd.daemon.metrics import Metrics
from kvd.daemon.outbound import PeerChannels, Tasks
from kvd.daemon.peers import Handshakes
from kvd.daemon.publisher import Publisher
from kvd.daemon.puller import Puller
from kvd.daemon.reaper import GONE_GRACE_SECONDS, Reaper, remove_orphans
from kvd.daemon.registration import host_id
from kvd.daemon.registry import Registry
from kvd.daemon.reports import AggregatorReports
from kvd.daemon.verifier import Verifier
from kvd.daemon.watchdog import LoopWatchdog
from kvd.transport.nixl import NixlAgent
from kvd.transport.nixl import available as nixl_available
from kvd.transport.tcp_client import TcpDataClient
from kvd.transport.tcp_server import TcpDataServer
from kvd.transport.wire_gate import WireGate

# A same-host peer's regions are checked this often for removal (a stat
# each): a few seconds of an ended worker's pages held, not peer_idle_seconds.
REMOVED_CHECK_SECONDS = 2.0


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        WorkerId(config.engine_id)  # validates the id
        self.config = config
        self.auth = AuthConfig.load(config.auth, config.token_file, config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
        self.epoch = uuid.uuid4().hex
        self.metrics = Metrics()
        self.nixl = self._nixl_agent(config)
        self.registry = Registry(config.engine_id, self.epoch, host_id(), lambda: self.data_address, self.metrics, self.nixl)
        self.publications = PublicationTable(config.lease_seconds, self.epoch)
        self.channels = PeerChannels(self.auth)
        self.tasks = Tasks()
        self.finished = FinishedSets(self.metrics, AggregatorReports(config.aggregator_address, self.registry, self.metrics, self.channels))
        self.wire_gate = WireGate(WireSchedule(config.shares, config.qos_slots), config.qos_chunk_bytes, self._granted,
                                  bulk_nice_increment=config.qos_bulk_nice) if config.qos_on else None
        self.data_client = TcpDataClient(Hello(engine_id=config.engine_id, epoch=self.epoch, shared_token=self.auth.token),
                                         connections_per_peer=config.connections_per_peer, copy_threads=config.copy_threads,
                                         stall_timeout_s=config.stall_timeout_seconds, stream_wait_s=config.pull_timeout_seconds, on_relayout=self.metrics.relayout_seconds.inc,
                                         tls=self.auth.data_plane_context(server=False), nixl=self.nixl, gate=self.wire_gate)
        self.publisher = Publisher(config, self.registry, self.publications, self.finished, self.metrics, self.auth)
        self.handshakes = Handshakes(config, self.registry, self.publisher, self.metrics, self.channels, self.data_client)
        self.verifier = Verifier(config.verify, config.verify_keep_seconds, self.metrics, full_fraction=config.verify_full_fraction)
        self.puller = Puller(config, self.registry, self.finished, self.handshakes, self.data_client, self.channels, self.tasks, self.metrics,
                             self.verifier)
        # A rank that ends takes its pulls, its publications and its finished-set streams with it.
        self.registry.rank_joined.append(self.finished.rank_joined)
        self.registry.rank_ended += [lambda rank, _why: self.puller.cancel_rank(rank), self.publisher.abort_rank, self.finished.rank_ended]
        self.registry.rank_retired.append(lambda rank, _why: self.puller.cancel_rank(rank))
        self.data_server = TcpDataServer(self.publisher, config.host, config.data_port, tls=self.auth.data_plane_context(server=True),
                                         nixl=self.nixl, nixl_staging_bytes=config.nixl_staging_bytes, gate=self.wire_gate)
        self._background: list[asyncio.Task[None]] = []
        self._watchdog: LoopWatchdog | None = None
        self.streams_ending = False  # after the drain: push streams send what is left and end
        self._grpc_address = ""

    def _granted(self, tag: QosTag, nbytes: int, waited: float) -> None:
        """A chunk got the wire (in its read's thread): counted by class and tenant."""
        self.metrics.qos_wait_seconds.labels(tag.priority).observe(waited)
        self.metrics.qos_bytes.labels(tag.priority, tag.tenant).inc(nbytes)

    def _nixl_agent(self, config: DaemonConfig) -> NixlAgent | None:
        if config.transport != "nixl":
            return None
        if self.auth.mode == "mtls":
            raise InvalidArgument("transport", "nixl", "cannot be used with auth: mtls (NIXL traffic is not encrypted)")
        why = nixl_available()
        if why:
            raise InvalidArgument("transport", "nixl", why)
        try:
            return NixlAgent(f"kvd-{config.engine_id}-{self.epoch[:8]}", config.nixl_progress_delay_us)
        except (ImportError, OSError) as e:
            raise InvalidArgument("transport", "nixl", f"NIXL failed to load: {e}") from None

    # ------------------------------------------------------------ lifecycle

    @property
    def grpc_address(self) -> str:
        """What peers dial for gRPC: set by the server once it is bound."""
        return self._grpc_address

    @grpc_address.setter
    def grpc_address(self, address: str) -> None:
        self._grpc_address = self.publisher.own_address = self.finished.own_address = address

    async def start(self) -> None:
        self.config.data_port = await self.data_server.start()
        remove_orphans()
        reaper = Reaper(self.registry.live_registrations, self.registry.retire,
                        lambda now: self.registry.end_retired(now, self.publications.holds, GONE_GRACE_SECONDS), self.registry.leftovers)
        loops: dict[str, Callable[[], Awaitable[None]]] = {
            "lease_expiry": self.publisher.sweep, "heartbeat": self.puller.heartbeat.run, "reports": self.finished.reports.run,
            "reaper": reaper.run, "idle_peers": self._forget_idle_peers}
        failed = self.metrics.background_errors.labels
        for name in loops:
            failed(name)  # each loop's count shows from 0, so an alert on its increase sees the first
        self._background = [asyncio.create_task(keep_running(name, run, lambda name: failed(name).inc()), name=f"kvd-{name}")
                            for name, run in loops.items()]
        self._watchdog = LoopWatchdog(asyncio.get_running_loop(), self.metrics.event_loop_lag)
        self._watchdog.start()

    async def _forget_idle_peers(self) -> None:
        """Now and then, forget the engines no pull has used for
        ``peer_idle_seconds``, and as their owner the readers idle as long;
        and unmap a same-host engine's memory once its worker let it go (a
        stat a region: every ``REMOVED_CHECK_SECONDS``)."""
        while True:
            await asyncio.sleep(min(self.config.peer_idle_seconds / 4, REMOVED_CHECK_SECONDS))
            busy = {p.params.remote_engine_id for p in self.puller.pulls.values()}
            now = time.monotonic()
            self.handshakes.drop_removed(busy)
            await self.handshakes.forget_idle(now, busy)
            self.publisher.forget_idle_readers(now, self.data_server.connected_readers())

    @property
    def draining(self) -> bool:
        """Draining: neither side takes new work (``drain`` tells both)."""
        return self.puller.draining

    @property
    def data_address(self) -> str:
        if self.config.data_advertise_address:
            return self.config.data_advertise_address
        return host_port(self.config.advertise_host or self.config.host, self.config.data_port)

    async def drain(self) -> None:
        """Stop new work; let in-flight pulls finish within the drain bound, then fail them."""
        self.publisher.draining = self.puller.draining = True
        tasks = [p.task for p in self.puller.pulls.values() if p.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.config.drain_seconds)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        # Report everything before exiting: give workers (and the aggregator)
        # a bounded time to collect what the drain produced.
        # Outcomes older than that bound were not read by now and will not be
        # (a box its engine never reads): they do not hold the exit up.
        start = time.monotonic()
        while time.monotonic() < min(start, self.finished.last_outcome_at) + self.config.drain_report_seconds and self.finished.unsent:
            await asyncio.sleep(0.05)

    def end_streams(self) -> None:
        """After the drain: every push stream sends what is left and ends, so
        stopping the gRPC server does not wait out its grace on open streams."""
        self.streams_ending = True
        self.finished.end_streams()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        for t in self._background:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.data_server.close()
        await self.data_client.close()
        if self.nixl is not None:
            self.nixl.close()
        await self.channels.close()
        self.handshakes.close()
        self.registry.close()

    # ------------------------------------------------------------ what spans both sides

    def abort(self, worker: WorkerId, request_id: str, release: TransferParams | None, token: bytes | None = None) -> bool:
        """Either side: D cancels its pull (and tells P, or releases ``release``), P ends its publication."""
        self.registry.registered(worker, token)
        check_request_id("request_id", request_id)
        rank = (worker.tp_rank, worker.pp_rank)
        pulled = self.puller.abort(worker, request_id, release, rank)
        published = self.publisher.abort(request_id, rank)
        return pulled or published
