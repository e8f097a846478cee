"""The ``kvd`` command: serve, demo, status."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _command_named(argv: list[str]) -> str | None:
    """The subcommand on a command line: its first word that is not a flag."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    from kvd import __version__

    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache transfer daemon for disaggregated prefill/decode serving")
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon", description=(
        "Settings come from a YAML file (--config or KVD_CONFIG), then KVD_<KEY> environment variables, "
        "then these flags; each later source wins. Every flag's key is its name with dashes as underscores."))
    s.add_argument("--config", help="YAML config file [KVD_CONFIG]")
    s.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    s.add_argument("--ready-file", default="", help="write a JSON line with the bound addresses once serving")
    for name, help_ in SERVE_FLAGS.items():
        s.add_argument(f"--{name}", default=None, help=help_)

    # The tools' own flags are defined in their modules, which import torch
    # (seconds): only the command being run loads its module, so `kvd status`
    # and `kvd --help` answer at once.
    wanted = _command_named(sys.argv[1:] if argv is None else argv)
    d = sub.add_parser("demo", help="a real P/D transfer on loopback, verified byte for byte")
    if wanted == "demo":
        from kvd.tools.demo import add_arguments

        add_arguments(d)

    b = sub.add_parser("bench", help="measure kvd against baselines in the same run, as ratios")
    if wanted == "bench":
        from kvd.tools.bench import add_arguments as bench_arguments

        bench_arguments(b)

    px = sub.add_parser("proxy", help="route OpenAI completions to a prefill server, then a decode server (P/D)")
    if wanted == "proxy":
        from kvd.integrations.pd_proxy import add_arguments as proxy_arguments

        proxy_arguments(px)

    st = sub.add_parser("status", help="show a daemon's workers, peers and work")
    st.add_argument("address", help="the daemon's gRPC address, host:port (or unix:PATH)")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--auth", default="none", choices=["none", "token", "mtls"], help="as the daemon's")
    st.add_argument("--token-file", default="", help="with --auth token: the file holding the shared token")
    st.add_argument("--tls-cert-file", default="", help="with --auth mtls: this client's certificate")
    st.add_argument("--tls-key-file", default="", help="with --auth mtls: its private key")
    st.add_argument("--tls-ca-file", default="", help="with --auth mtls: the CA that signed the daemon's certificate")

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from kvd.tools.demo import run_demo

        return run_demo(args)
    if args.command == "bench":
        from kvd.tools.bench import run_bench

        return run_bench(args)
    if args.command == "proxy":
        from kvd.integrations.pd_proxy import serve

        return serve(args)
    if args.command == "status":
        from kvd.auth import AuthConfig
        from kvd.core.errors import InvalidArgument

        try:
            auth = AuthConfig.load(args.auth, args.token_file, args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
        except (InvalidArgument, OSError) as e:
            print(f"kvd: {getattr(e, 'message', e)}", file=sys.stderr)
            return 2
        return _status(args.address, args.json, auth)
    return 2


SERVE_FLAGS = {
    "engine-id": "engine this daemon serves",
    "host": "listen address (default 127.0.0.1)",
    "advertise-host": "address peers dial (default: host)",
    "grpc-port": "gRPC port (default 50051; 0 picks a free one)",
    "data-port": "data-plane port (default 50052; 0 picks a free one)",
    "metrics-port": "Prometheus port (default 9400; -1 disables)",
    "data-advertise-address": "host:port peers dial for the data plane",
    "lease-seconds": "how long published blocks are held without a heartbeat (default 120)",
    "publish-wait-seconds": "how long a read of params made before publishing (vLLM) waits for the publication (default 10)",
    "layer-wait-seconds": "layer-wise streaming: how long a read waits for prefill to save its next layer (default 30)",
    "connections-per-peer": "data connections to each peer (default 4)",
    "segment-bytes": "bytes of one data frame, the unit of pipelining (default 4 MiB)",
    "in-place-segment-bytes": "bytes of one data frame over TCP where both sides hold the wire layout (default 32 MiB)",
    "stripes-per-read": "connections one big read of a remote rank is striped over (default 2)",
    "stripe-min-bytes": "reads at least this big are striped (default 32 MiB)",
    "copy-threads": "threads of one same-host copy or relayout (default 2)",
    "transport": "data plane: tcp (default) or nixl (NIXL/UCX moves the bytes; pip install 'kvd[nixl]')",
    "nixl-staging-bytes": "transport nixl: cap on one read's gather staging per connection (default 1 GiB)",
    "nixl-progress-delay-us": "transport nixl: how long NIXL's progress thread waits for a UCX event (default 10000; 0 spins a core)",
    "pull-timeout-seconds": "bound on one pull (default 60)",
    "stall-timeout-seconds": "a peer silent this long fails the read (default 10)",
    "peer-idle-seconds": "an engine not read from this long is forgotten: its same-host mappings unmapped, its connections closed (default 300)",
    "max-concurrent-pulls": "more are queued and kept alive by heartbeat (default 64)",
    "aggregator-address": "the engine's aggregator daemon (default: this one)",
    "same-host": "auto: direct copies between mapped regions when peers share a host; off: always TCP",
    "drain-seconds": "SIGTERM: how long in-flight pulls may finish (default 10)",
    "drain-report-seconds": "SIGTERM, then: how long workers get to read outcomes, from the newest (default 5)",
    "auth": "none, token or mtls (docs/security.md)",
    "token-file": "auth=token: file holding the shared token (mode 600)",
    "tls-cert-file": "auth=mtls: this daemon's certificate chain (PEM)",
    "tls-key-file": "auth=mtls: its private key (PEM, mode 600)",
    "tls-ca-file": "auth=mtls: the CA that signs every peer's certificate",
    "worker-api": "local (default): Worker RPCs only from this host; any: from anywhere",
    "worker-socket": "also serve the Worker API on this Unix socket path",
    "verify": "off (default), sampled or full: digest what is published, check what lands against it (docs/verification.md)",
    "verify-keep-seconds": "how long a publication's digests are kept for its readers (default 60)",
    "verify-full-fraction": "with --verify sampled: this share of requests is checked whole instead (default 0)",
    "qos": "off (default): pulls share the wire first come, first served; on: by class, deadline and tenant (docs/qos.md)",
    "tenants": "name=share,... : each tenant's share of a contended wire (naming any turns qos on)",
    "qos-chunk-bytes": "qos on: what a read moves between two looks at the wire's order (default 1 MiB)",
    "qos-slots": "qos on: chunks of each lane (interactive; the rest) on the wire at once (default 2)",
    "qos-read-bytes": "qos on: the most one TCP read moves; a bigger one is cut into more, for the wire's order (default 64 MiB)",
    "qos-bulk-nice": "qos on: how far above the daemon's nice value the threads moving non-interactive reads run, 0-19 (default 10)",
    "log-format": "text (key=value) or json",
    "log-level": "DEBUG, INFO, WARNING or ERROR",
}


def _serve(args: argparse.Namespace) -> int:
    import faulthandler
    import signal

    # First, before the imports (torch's alone takes a second): a crash in
    # native code (a driver, CUDA IPC, NIXL) leaves its Python stack in the
    # log instead of a bare exit status, and SIGUSR1 writes every thread's
    # stack there and the daemon serves on. faulthandler writes from the
    # signal handler without the GIL, so this shows where a daemon is stuck
    # even when no Python thread can run (a native call holding the GIL),
    # and where one that is slow to start spends its time.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from kvd.daemon import config as cfg

    flags = {name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name in SERVE_FLAGS}
    try:
        config = cfg.load(args.config, flags=flags)
    except cfg.ConfigError as e:
        print(f"kvd: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.describe(config), end="")
        return 0
    from kvd.daemon.server import run

    return run(config, args.ready_file or None)


def _table(title: str, header: list[str], rows: list[tuple[object, ...]]) -> None:
    print(title)
    if not rows:
        print("  (none)\n")
        return
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for j, row in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))
    print()


def _status(address: str, as_json: bool, auth: Any) -> int:
    from google.protobuf.json_format import MessageToDict

    from kvd.client import daemon_status
    from kvd.core.errors import KvdError

    try:
        r = daemon_status(address, auth, timeout=5, wait_ready=False)
    except KvdError as e:
        print(f"kvd: {address}: {e.status.name}: {e.message}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(MessageToDict(r), indent=2))
        return 0
    state = "draining" if r.draining else "serving"
    print(f"kvd {r.version}  engine {r.engine_id}  epoch {r.epoch[:8]}  {state}")
    print(f"peers: {', '.join(r.peers) or '-'}    tasks: {r.tasks}    staging: {r.staging_buffers} buffers, {r.staging_bytes / 1e6:.1f} MB"
          f"    pinned ranks: {r.pinned_ranks}")
    print()
    _table("workers", ["worker", "regions", "layers", "registered"],
           [(f"tp{w.worker.tp_rank}/{w.worker.tp_size} pp{w.worker.pp_rank}/{w.worker.pp_size}", w.regions, w.layers, f"{w.bytes / 1e6:,.1f} MB") for w in r.workers])
    _table(f"leases ({r.publications})", ["request", "generation", "ranks", "expires in"],
           [(x.request_id, x.generation, ",".join(x.ranks), f"{x.expires_in_seconds:.1f}s") for x in r.leases])
    _table(f"pulls in flight ({r.pulls_in_flight})", ["request", "worker", "from", "age", "phase", "landed"],
           [(x.request_id, x.worker, x.remote_engine_id, f"{x.age_seconds:.1f}s", x.phase,
             f"{x.landed_bytes / 1e6:,.1f} of {x.planned_bytes / 1e6:,.1f} MB" if x.planned_bytes else "-") for x in r.pulls])
    if r.queues:  # --qos on
        _table("the wire's queues", ["side", "class", "tenant", "waiting", "moving", "sent"],
               [(x.side, x.priority, x.tenant or "(default)", x.waiting, x.moving, f"{x.granted_bytes / 1e6:,.1f} MB" if x.side == "send" else "-")
                for x in r.queues])
    _table("recent failures", ["request", "reason", "ago", "message"],
           [(x.request_id, x.reason, f"{x.age_seconds:.0f}s", x.message[:80]) for x in r.recent_failures])
    return 0
