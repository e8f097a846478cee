"""Two real daemons (P and D) and one worker of each in this process, for
the benches that move requests through them (``transport``, ``load``)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvd.core.spec import NAMED_LAYOUTS, KVCacheSpec, ModelInfo


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def p50(samples: list[float]) -> float:
    """The median of ``samples`` (the upper one of an even count)."""
    return sorted(samples)[len(samples) // 2]


def p99(samples: list[float]) -> float:
    """The 99th percentile of ``samples``: of fewer than 100, the largest."""
    return sorted(samples)[min(len(samples) - 1, int(len(samples) * 0.99))]


class BenchPair:
    """A P and a D daemon, and one worker of each in this process."""

    def __init__(self, mode: str, flags: tuple[str, ...] = ()) -> None:
        from kvd.tools.demo import Daemons

        self.daemons = Daemons()
        flag = ["--same-host", "auto" if mode == "samehost" else "off"]
        if mode == "nixl":
            flag += ["--transport", "nixl"]
        # Workers reach their daemon over its Unix socket, as in the sidecar
        # deployment: a gRPC call there costs about 2/3 of one over loopback TCP.
        # Launched, not waited for: both boot at once, and so do the pairs a
        # section makes before it prepares any (most of a start is importing torch).
        self._p = self.daemons.launch("bench-p", [*flag, *flags, "--worker-socket", os.path.join(self.daemons.tmp, "p.sock")])
        self._d = self.daemons.launch("bench-d", [*flag, *flags, "--worker-socket", os.path.join(self.daemons.tmp, "d.sock")])
        self.done: dict[str, float] = {}
        self._block_size = self._blocks = self._bytes = self._tries = 0
        self._name, self._rng = "", random.Random(0)
        self.cv = threading.Condition()
        self.p_client: Any = None
        self.d_client: Any = None
        self._keep: list[torch.Tensor] = []  # GPU caches the daemons mapped
        self._watch: Any = None

    @property
    def p(self) -> dict[str, Any]:
        """P's ready file (its addresses), once it serves."""
        return self.daemons.ready(self._p)

    @property
    def d(self) -> dict[str, Any]:
        """D's ready file (its addresses), once it serves."""
        return self.daemons.ready(self._d)

    def register(self, spec: KVCacheSpec, layers: int, device: str = "cpu") -> None:
        from kvd.caches import allocate_kv_caches, torch_dtype
        from kvd.client import KvdClient
        from kvd.core.spec import WorkerId

        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        model = ModelInfo(layers, spec.num_kv_heads)
        for attr, side, eid, daemon in (("p_client", "p", "bench-p", self._p), ("d_client", "d", "bench-d", self._d)):
            self.daemons.ready(daemon)  # serving (or the run ends with its log)
            client = getattr(self, attr) or KvdClient(f"unix:{os.path.join(self.daemons.tmp, side + '.sock')}", WorkerId(eid))
            client.wait_ready()
            if device == "cpu":
                caches = allocate_kv_caches(spec, names)
            else:  # one GPU buffer, every layer a view into it (registered by CUDA IPC handle)
                buffer = torch.zeros(layers, *spec.part_shape(), dtype=torch_dtype(spec.dtype), device=device)
                caches = {name: buffer[i] for i, name in enumerate(names)}
                self._keep.append(buffer)
            client.register(caches, model, spec)
            setattr(self, attr, client)
        if self._watch is None:
            self._watch = threading.Thread(target=self._consume, daemon=True)
            self._watch.start()

    def _consume(self) -> None:
        import grpc

        try:
            for f in self.d_client.watch_engine_finished():
                with self.cv:
                    for rid in f.finished_recving:
                        self.done[rid] = time.perf_counter()
                    self.cv.notify_all()
        except grpc.RpcError:
            pass

    def transfer(self, rid: str, p_ids: list[int], d_ids: list[int], num_tokens: int, timeout: float = 120, **qos: Any) -> float:
        """Publish, pull (``qos``: the pull's priority, tenant, deadline) and wait:
        seconds from the pull to D's finished set. The finish is taken as it is
        read, so a request id used again times its own request."""
        params = self.p_client.publish(rid, [p_ids], num_tokens)
        t0 = time.perf_counter()
        self.d_client.pull(rid, params, [d_ids], **qos)
        with self.cv:
            if not self.cv.wait_for(lambda: rid in self.done, timeout=timeout):
                raise SystemExit(f"bench request {rid} did not finish")
            return self.done.pop(rid) - t0

    def prepare(self, name: str, unit: int, nbytes: int, layers: int, rng: random.Random, device: str = "cpu") -> None:
        """Caches for requests of ``nbytes`` in scattered blocks of ``unit``
        bytes per layer (fresh random block ids each try), and one untimed
        request: the first on fresh caches pays for the handshake, same-host
        mapping and connections, which a serving daemon pays once, not per
        request (the NIXL baseline in bench_peers warms up the same way)."""
        # 8 KV heads x 128 x bf16 x K+V = 4 KiB per token per layer
        self._block_size = unit // 4096
        self._blocks = max(1, nbytes // (unit * layers))
        self._bytes = self._blocks * unit * layers
        self._name, self._rng, self._tries = name, rng, 0
        self.register(KVCacheSpec(self._block_size, 8, 128, "bfloat16", NAMED_LAYOUTS["NHD"], self._blocks + 1), layers, device)
        self.transfer(f"{name}-warm", *self._ids(), self._blocks * self._block_size)

    def _ids(self) -> tuple[list[int], list[int]]:
        ids = range(1, self._blocks + 1)
        return self._rng.sample(ids, self._blocks), self._rng.sample(ids, self._blocks)

    def one_try(self) -> tuple[float, float]:
        """One timed request as ``prepare`` set up: its GB/s, and CPU seconds
        per GB of both daemons and this process (the workers), pull to landed."""
        p_ids, d_ids = self._ids()
        cpu = self.cpu_seconds()
        seconds = self.transfer(f"{self._name}-{self._tries}", p_ids, d_ids, self._blocks * self._block_size)
        self._tries += 1
        return self._bytes / seconds / 1e9, (self.cpu_seconds() - cpu) / (self._bytes / 1e9)

    def cpu_seconds(self) -> float:
        """CPU seconds so far of both daemons and of this process."""
        from kvd.tools.bench_socket import process_cpu_seconds

        return sum(process_cpu_seconds(p.pid) for p in self.daemons.procs) + time.process_time()

    def timings(self) -> dict[str, tuple[float, float]]:
        """(sum of seconds, count) so far of D's pull phases (``kvd_pull_phase_seconds``)
        and of P serving a read (``serve``), from the daemons' /metrics."""
        from kvd.testing.metrics import histogram_sums

        out = histogram_sums(f"http://{self.d['metrics']}/metrics", "kvd_pull_phase_seconds", "phase")
        out.pop("", None)
        out["serve"] = histogram_sums(f"http://{self.p['metrics']}/metrics", "kvd_read_serve_seconds", "")[""]
        return out

    def close(self) -> None:
        from kvd.caches import release_all

        # The bench reads the engine's sets; its workers' own boxes are read
        # here, as an engine's workers would, so a stopping daemon has no
        # unread outcome to wait on.
        for client in (self.p_client, self.d_client):
            if client is not None:
                with contextlib.suppress(Exception):  # a daemon that died must not keep the rest running
                    client.get_finished()
        self.daemons.stop()
        release_all()
