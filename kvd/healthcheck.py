"""``python -m kvd.healthcheck [ADDRESS]``: exit 0 when the daemon's gRPC health is SERVING.

Used by the Dockerfile's HEALTHCHECK, where no grpc_health_probe binary exists.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else f"127.0.0.1:{os.environ.get('KVD_GRPC_PORT', '50051')}"
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    except grpc.RpcError as e:
        print(f"kvd health: {address}: {e.code().name}", file=sys.stderr)
        return 1
    ok = resp.status == health_pb2.HealthCheckResponse.SERVING
    print(f"kvd health: {address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
