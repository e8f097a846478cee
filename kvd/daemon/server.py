"""``kvd serve``: run one daemon until SIGTERM/SIGINT, then drain and exit 0."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

import torch
import uvloop
from prometheus_client import start_http_server

from kvd import __version__
from kvd.core.errors import KvdError
from kvd.daemon.daemon import Daemon, DaemonConfig
from kvd.daemon.service import NOT_SERVING, SERVING, build_server

log = logging.getLogger("kvd.serve")


async def serve(config: DaemonConfig, ready_file: str | None = None) -> None:
    # Copies here are a few MiB each; torch's intra-op pool only adds
    # spinning threads that compete with the sockets for the node's cores.
    torch.set_num_threads(1)
    try:
        daemon = Daemon(config)
    except KvdError as e:
        raise SystemExit(f"kvd: {e.message}") from None
    await daemon.start()
    server, health = build_server(daemon)
    creds = daemon.auth.server_credentials()
    address = f"{config.host}:{config.grpc_port}"
    grpc_port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    if config.worker_socket:
        # Workers on this host may also come over a Unix socket (file permissions apply).
        server.add_insecure_port(f"unix:{config.worker_socket}")
    if grpc_port == 0:
        raise SystemExit(f"kvd: cannot bind gRPC on {config.host}:{config.grpc_port}")
    config.grpc_port = grpc_port
    daemon.grpc_address = f"{config.advertise_host or config.host}:{grpc_port}"
    metrics_port = -1
    if config.metrics_port >= 0:
        httpd, _thread = start_http_server(config.metrics_port, addr=config.host, registry=daemon.metrics.registry)
        metrics_port = httpd.server_port
    await server.start()
    await health.set("", SERVING)
    for name in ("kvd.v1.Worker", "kvd.v1.Peer", "kvd.v1.Admin"):
        await health.set(name, SERVING)
    info = {
        "engine_id": config.engine_id, "epoch": daemon.epoch, "grpc": daemon.grpc_address,
        "data": daemon.data_address, "data_bind": f"{config.host}:{config.data_port}", "metrics": f"{config.host}:{metrics_port}" if metrics_port >= 0 else "off",
        "version": __version__, "pid": os.getpid(),
    }
    log.info("kvd serving " + " ".join(f"{k}={v}" for k, v in info.items()))
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(ready_file + ".tmp", ready_file)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("kvd draining: %d pulls in flight", len(daemon.puller.pulls))
    await health.enter_graceful_shutdown() if hasattr(health, "enter_graceful_shutdown") else await health.set("", NOT_SERVING)
    await daemon.drain()
    await server.stop(grace=2)
    await daemon.close()
    log.info("kvd stopped")


def run(config: DaemonConfig, ready_file: str | None = None) -> int:
    from kvd.logs import setup

    setup(config.log_format, config.log_level)
    uvloop.run(serve(config, ready_file))
    if config.transport == "nixl":
        # Everything is closed and logged. NIXL 1.5's UCX crashes in its exit-time
        # teardown (SIGSEGV) on hosts that have libibverbs but no RDMA device, so
        # a clean stop would still exit -11: leave before that teardown runs.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
