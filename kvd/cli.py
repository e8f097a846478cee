"""The ``kvd`` command: serve, demo, status."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KVD_{name}", default)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache transfer daemon for disaggregated prefill/decode serving")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon (flags override KVD_* environment variables)")
    s.add_argument("--engine-id", default=_env("ENGINE_ID", ""), help="engine this daemon serves [KVD_ENGINE_ID]")
    s.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="listen address [KVD_HOST]")
    s.add_argument("--advertise-host", default=_env("ADVERTISE_HOST", ""), help="address peers dial [KVD_ADVERTISE_HOST]")
    s.add_argument("--grpc-port", type=int, default=int(_env("GRPC_PORT", "50051")), help="[KVD_GRPC_PORT]; 0 picks a free port")
    s.add_argument("--data-port", type=int, default=int(_env("DATA_PORT", "50052")), help="[KVD_DATA_PORT]; 0 picks a free port")
    s.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "9400")), help="[KVD_METRICS_PORT]; -1 disables")
    s.add_argument("--lease-seconds", type=float, default=float(_env("LEASE_SECONDS", "120")))
    s.add_argument("--connections-per-peer", type=int, default=int(_env("CONNECTIONS_PER_PEER", "4")))
    s.add_argument("--pull-timeout-seconds", type=float, default=float(_env("PULL_TIMEOUT_SECONDS", "60")))
    s.add_argument("--data-advertise-address", default=_env("DATA_ADVERTISE_ADDRESS", ""), help="host:port peers dial for the data plane [KVD_DATA_ADVERTISE_ADDRESS]")
    s.add_argument("--stall-timeout-seconds", type=float, default=float(_env("STALL_TIMEOUT_SECONDS", "10")), help="a peer silent this long fails the read [KVD_STALL_TIMEOUT_SECONDS]")
    s.add_argument("--max-concurrent-pulls", type=int, default=int(_env("MAX_CONCURRENT_PULLS", "64")), help="more are queued [KVD_MAX_CONCURRENT_PULLS]")
    s.add_argument("--aggregator-address", default=_env("AGGREGATOR_ADDRESS", ""), help="the engine's aggregator daemon (default: this one) [KVD_AGGREGATOR_ADDRESS]")
    s.add_argument("--drain-seconds", type=float, default=float(_env("DRAIN_SECONDS", "10")), help="SIGTERM: how long in-flight pulls may finish [KVD_DRAIN_SECONDS]")
    s.add_argument("--ready-file", default="", help="write a JSON line with the bound addresses once serving")

    d = sub.add_parser("demo", help="a real P/D transfer on loopback, verified byte for byte")
    from kvd.demo import add_arguments

    add_arguments(d)

    b = sub.add_parser("bench", help="measure kvd against baselines in the same run, as ratios")
    from kvd.bench import add_arguments as bench_arguments

    bench_arguments(b)

    st = sub.add_parser("status", help="show a daemon's workers, peers and work")
    st.add_argument("address")
    st.add_argument("--json", action="store_true")

    args = parser.parse_args(argv)
    if args.command == "serve":
        if not args.engine_id:
            parser.error("--engine-id (or KVD_ENGINE_ID) is required")
        from kvd.daemon.daemon import DaemonConfig
        from kvd.daemon.serve import run
        from kvd.errors import InvalidArgument

        try:
            config = DaemonConfig(
                engine_id=args.engine_id, host=args.host, advertise_host=args.advertise_host, grpc_port=args.grpc_port,
                data_port=args.data_port, metrics_port=args.metrics_port, lease_seconds=args.lease_seconds,
                connections_per_peer=args.connections_per_peer, pull_timeout_seconds=args.pull_timeout_seconds,
                drain_seconds=args.drain_seconds, stall_timeout_seconds=args.stall_timeout_seconds,
                max_concurrent_pulls=args.max_concurrent_pulls, aggregator_address=args.aggregator_address,
                data_advertise_address=args.data_advertise_address,
            )
            from kvd.spec import WorkerId

            WorkerId(config.engine_id)
        except InvalidArgument as e:
            print(f"kvd: {e.message.replace('worker.engine_id', 'engine-id')}", file=sys.stderr)
            return 2
        return run(config, args.ready_file or None)
    if args.command == "demo":
        from kvd.demo import run_demo

        return run_demo(args)
    if args.command == "bench":
        from kvd.bench import run_bench

        return run_bench(args)
    if args.command == "status":
        return _status(args.address, args.json)
    return 2


def _status(address: str, as_json: bool) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from kvd.proto import kvd_pb2 as pb
    from kvd.proto import kvd_pb2_grpc as pbg

    with grpc.insecure_channel(address) as ch:
        try:
            r = pbg.AdminStub(ch).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError as e:
            print(f"kvd: {address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if as_json:
        print(json.dumps(MessageToDict(r), indent=2))
        return 0
    print(f"engine {r.engine_id}  epoch {r.epoch[:8]}  version {r.version}")
    print(f"publications {r.publications}  pulls in flight {r.pulls_in_flight}  peers {', '.join(r.peers) or '-'}")
    print(f"{'worker':<28} {'regions':>7} {'layers':>6} {'bytes':>14}")
    for w in r.workers:
        name = f"tp{w.worker.tp_rank}/{w.worker.tp_size} pp{w.worker.pp_rank}/{w.worker.pp_size}"
        print(f"{name:<28} {w.regions:>7} {w.layers:>6} {w.bytes:>14,}")
    return 0
