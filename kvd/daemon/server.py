"""``kvd serve``: one daemon's lifecycle, uvicorn-style.

``Server(config)`` owns the process-level pieces around a ``Daemon``: the
gRPC server (TCP and, optionally, the workers' Unix socket), the health
service, the metrics endpoint, the ready file and the signals. ``serve``
runs ``startup``, waits until ``should_exit`` (SIGTERM/SIGINT), then
``shutdown``: health goes NOT_SERVING, in-flight pulls drain, and
everything is reported before the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
from typing import Any

import grpc
import torch
import uvloop
from grpc_health.v1 import health
from prometheus_client import start_http_server

from kvd import __version__
from kvd.core.addresses import host_port
from kvd.core.errors import KvdError
from kvd.daemon.config import DaemonConfig
from kvd.daemon.daemon import Daemon
from kvd.daemon.service import NOT_SERVING, SERVING, build_server

log = logging.getLogger("kvd.serve")

SERVICES = ("kvd.v1.Worker", "kvd.v1.Peer", "kvd.v1.Admin")


class Server:
    def __init__(self, config: DaemonConfig, ready_file: str | None = None) -> None:
        self.config = config
        self.ready_file = ready_file
        self.should_exit = asyncio.Event()
        self.daemon: Daemon | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: health.HealthServicer | None = None
        self.info: dict[str, Any] = {}

    async def serve(self) -> None:
        await self.startup()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.should_exit.set)
        await self.should_exit.wait()
        await self.shutdown()

    async def startup(self) -> None:
        config = self.config
        # Copies here are a few MiB each; torch's intra-op pool only adds
        # spinning threads that compete with the sockets for the node's cores.
        torch.set_num_threads(1)
        try:
            daemon = self.daemon = Daemon(config)
        except KvdError as e:
            raise SystemExit(f"kvd: {e.message}") from None
        await daemon.start()
        server, self._health = build_server(daemon)
        self._grpc = server
        creds = daemon.auth.server_credentials()
        address = host_port(config.host, config.grpc_port)
        grpc_port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        if config.worker_socket:
            # Workers on this host may also come over a Unix socket (file permissions apply).
            server.add_insecure_port(f"unix:{config.worker_socket}")
        if grpc_port == 0:
            raise SystemExit(f"kvd: cannot bind gRPC on {address}")
        config.grpc_port = grpc_port
        daemon.grpc_address = host_port(config.advertise_host or config.host, grpc_port)
        metrics_port = -1
        if config.metrics_port >= 0:
            httpd, _thread = start_http_server(config.metrics_port, addr=config.host, registry=daemon.metrics.registry)
            metrics_port = httpd.server_port
        # Everything made so far (modules, torch, grpc: ~180k objects) lives as
        # long as the process. Frozen, a full collection no longer walks it:
        # one took 80 ms here, every thread stopped, at start-up.
        gc.freeze()
        await server.start()
        for name in ("", *SERVICES):
            await self._health.set(name, SERVING)
        self.info = {
            "engine_id": config.engine_id, "epoch": daemon.epoch, "grpc": daemon.grpc_address,
            "data": daemon.data_address, "data_bind": host_port(config.host, config.data_port),
            "metrics": host_port(config.host, metrics_port) if metrics_port >= 0 else "off", "version": __version__, "pid": os.getpid(),
        }
        log.info("kvd serving " + " ".join(f"{k}={v}" for k, v in self.info.items()))
        if self.ready_file:
            with open(self.ready_file + ".tmp", "w") as f:
                json.dump(self.info, f)
            os.replace(self.ready_file + ".tmp", self.ready_file)

    async def shutdown(self) -> None:
        daemon, server, health_servicer = self.daemon, self._grpc, self._health
        assert daemon is not None and server is not None and health_servicer is not None
        log.info("kvd draining: %d pulls in flight", len(daemon.puller.pulls))
        if hasattr(health_servicer, "enter_graceful_shutdown"):
            await health_servicer.enter_graceful_shutdown()
        else:
            await health_servicer.set("", NOT_SERVING)
        await daemon.drain()
        daemon.end_streams()
        await server.stop(grace=2)
        await daemon.close()
        log.info("kvd stopped")


def run(config: DaemonConfig, ready_file: str | None = None) -> int:
    from kvd.logs import setup

    setup(config.log_format, config.log_level)
    # faulthandler (crashes, and stacks on SIGUSR1) is set up by `kvd serve`
    # (cli._serve) before any import.
    uvloop.run(Server(config, ready_file).serve())
    if config.transport == "nixl":
        # Everything is closed and logged. NIXL 1.5's UCX crashes in its exit-time
        # teardown (SIGSEGV) on hosts that have libibverbs but no RDMA device, so
        # a clean stop would still exit -11: leave before that teardown runs.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
